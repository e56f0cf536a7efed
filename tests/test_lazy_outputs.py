"""Work nobody asked for is skipped: text is decoded when read, ids are checked once, stops masked at once."""

from __future__ import annotations

import pytest
import torch

import nnrun
from nnrun.request import Request


def _counting_detokenize(llm: nnrun.LLM, monkeypatch) -> list[str]:
    calls: list[str] = []
    checker = llm.core.stop_checker
    real = checker.detokenize
    monkeypatch.setattr(checker, "detokenize", lambda req: calls.append(req.request_id) or real(req))
    return calls


def test_a_finished_request_is_decoded_only_when_its_output_is_read(tiny_llm, monkeypatch):
    llm, tokenizer = tiny_llm
    calls = _counting_detokenize(llm, monkeypatch)
    req = llm.make_request("The", nnrun.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    handle = llm.submit_requests([req])[0]
    handle._done.wait(60)
    assert req.is_finished and req.text is None and calls == []  # finished, and nothing decoded yet
    output = handle.result()
    assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
    assert calls == [req.request_id] and handle.result() is output  # decoded once


def test_generate_and_streams_still_carry_text(tiny_llm):
    llm, tokenizer = tiny_llm
    params = nnrun.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    output = llm.generate(["The", "A dog"], params)[1].outputs[0]
    assert output.text == tokenizer.decode(output.token_ids, skip_special_tokens=True)
    streamed = list(llm.generate_stream("The", params))
    assert streamed[-1].finished and streamed[-1].outputs[0].text == llm.generate("The", params)[0].outputs[0].text


def test_a_trace_decodes_nothing_and_its_requests_still_give_text_when_asked(monkeypatch):
    model = nnrun.LanguageModel("tiny-facts")
    try:
        calls = _counting_detokenize(model.engine, monkeypatch)
        with model.trace() as tracer:
            with tracer.invoke("The Eiffel Tower is in"):
                hidden = model.model.layers[0].output.save()
            with tracer.invoke("Rome is in"):
                pass
        assert hidden.shape[1] > 0 and calls == []
        with model.generate("The Eiffel Tower is in", max_new_tokens=3) as tracer:
            ids = tracer.result.save()
        assert calls == []
        req = model.engine.make_request(ids[0].tolist(), nnrun.SamplingParams(max_tokens=1, temperature=0))
        text = model.engine.submit_requests([req])[0].result().outputs[0].text
        assert text == model.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
    finally:
        model.shutdown()


def test_checked_ids_skip_the_token_checks_but_not_the_length_check(tiny_llm):
    llm, _ = tiny_llm
    params = nnrun.SamplingParams(max_tokens=1)
    req = llm.make_request_from_ids([5, 6, 7], params, request_id="checked")
    assert isinstance(req, Request) and req.prompt_token_ids == [5, 6, 7] and req.request_id == "checked"
    too_long = [1] * min(llm.runner.max_model_len, llm.runner.max_total_tokens)
    with pytest.raises(ValueError, match="at least one new token must fit"):
        llm.make_request_from_ids(too_long, params)
    with pytest.raises(ValueError, match="out of the vocabulary"):  # the user's door still checks every id
        llm.make_request([5, llm.vocab_size], params)


def test_min_tokens_masks_every_stop_of_every_short_row_and_nothing_without_stops(tiny_llm):
    llm, _ = tiny_llm
    runner = llm.runner
    held = nnrun.SamplingParams(max_tokens=4, min_tokens=3, stop_token_ids=[7, 9])
    free = nnrun.SamplingParams(max_tokens=4, stop_token_ids=[7])
    reqs = [Request("short", [1, 2], held), Request("free", [1, 2], free), Request("done", [1], held)]
    reqs[2].output_token_ids = [4, 4, 4]  # already has its min_tokens
    logits = torch.zeros(3, 16)  # [B, V]
    masked = runner._mask_stops_before_min_tokens(logits, reqs)
    stops = {*runner.eos_token_ids, 7, 9}
    expected = torch.zeros(3, 16)
    expected[0, [t for t in stops if t < 16]] = float("-inf")
    assert torch.equal(masked, expected) and torch.equal(logits, torch.zeros(3, 16))  # the served logits unchanged
    # Rows sharing one SamplingParams, all short (a batch's usual case: masked by columns), then one of them not
    shared = [Request(f"shared{i}", [1, 2], held) for i in range(3)]
    for done_row in (None, 1):
        if done_row is not None:
            shared[done_row].output_token_ids = [4, 4, 4]
        masked = runner._mask_stops_before_min_tokens(logits, shared)
        expected = torch.zeros(3, 16)
        for row in range(3):
            if row != done_row:
                expected[row, [t for t in stops if t < 16]] = float("-inf")
        assert torch.equal(masked, expected), done_row
    no_stops = [Request("plain", [1], nnrun.SamplingParams(max_tokens=4, min_tokens=3))]
    eos, runner.eos_token_ids = runner.eos_token_ids, set()
    try:
        same = logits[:1]
        assert runner._mask_stops_before_min_tokens(same, no_stops) is same  # nothing to forbid: no copy
    finally:
        runner.eos_token_ids = eos
