"""A traced prompt's LM head runs over every position only while a block can still read the logits.

Oracle: nnsight on HF over a twin of the same weights. The rows nnrun's head ran over are counted at
its weight's matmul (no hook on the head: a hook would be someone watching). A trace that reads a
layer pays for the sampled rows only; one that reads the head's output, the model's output, the
trace's result or `model.logits` gets every position, as today; prompt logprobs are untouched.
"""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import nnrun
from conformance.compare import assert_same
from conformance.models import oracle_and_nnrun, tiny_llama, tiny_tokenizer
from conformance.scenarios import A, B, C, Padded, n_tokens
from tolerance import assert_close_packed

WAIT_S = 60


@pytest.fixture(scope="module")
def models():
    oracle, ours = oracle_and_nnrun(tiny_llama(seed=5), tiny_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield oracle, ours
    ours.shutdown()


@pytest.fixture
def head_rows(models, monkeypatch) -> list[int]:
    """The number of rows of each call of nnrun's LM head, as its weight's matmul saw them."""
    weight = models[1].engine.runner.model.get_output_embeddings().weight
    linear = torch.nn.functional.linear
    seen: list[int] = []

    def counting(input: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if w is weight:
            seen.append(input.shape[-2])  # [1, rows, H]
        return linear(input, w, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    return seen


def both(models, scenario):
    oracle, ours = models
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return scenario(oracle), scenario(ours)


def lengths(models, *texts: str) -> list[int]:
    return [n_tokens(models[1].tokenizer, text) for text in texts]


def test_a_prefill_trace_reading_a_layer_runs_the_head_on_the_sampled_rows_only(models, head_rows):
    def scenario(model):
        saved = []
        with model.trace() as tracer:
            for text in (A, B, C):
                with tracer.invoke(text):
                    saved.append(model.model.layers[1].output.save())
        return saved

    expected, actual = both(models, scenario)
    sizes = lengths(models, A, B, C)
    assert head_rows == [3]  # one row per prompt: the next token's (HF's own forward ran on the oracle's head)
    assert_same([Padded(v, [n]) for v, n in zip(expected, sizes)], [Padded(v, [n]) for v, n in zip(actual, sizes)])


def test_a_block_that_reads_a_layer_then_the_head_gets_every_position(models, head_rows):
    """Served at layer 1, the second invoke's block next waits on the head: the head runs on every row."""

    def scenario(model):
        with model.trace() as tracer:
            with tracer.invoke(A):
                h = model.model.layers[1].output.save()
            with tracer.invoke(B):
                g = model.model.layers[1].output.save()
                logits = model.lm_head.output.save()
        return h, g, logits

    (h0, g0, l0), (h1, g1, l1) = both(models, scenario)
    sizes = lengths(models, A, B)
    assert head_rows == [sum(sizes)]
    assert_same(
        [Padded(h0, sizes[:1]), Padded(g0, sizes[1:]), Padded(l0, sizes[1:])],
        [
            Padded(h1, sizes[:1]),
            Padded(g1, sizes[1:]),
            Padded(l1, sizes[1:]),
        ],
    )


@pytest.mark.parametrize("read", ["model_output", "result"])
def test_a_trace_reading_the_model_output_or_its_result_gets_every_position(models, head_rows, read):
    def scenario(model):
        with model.trace() as tracer:
            with tracer.invoke(A):
                h = model.model.layers[0].output.save()
            with tracer.invoke(C):
                out = model.output.logits.save() if read == "model_output" else tracer.result.logits.save()
        return h, out

    (h0, out0), (h1, out1) = both(models, scenario)
    sizes = lengths(models, A, C)
    assert head_rows == [sum(sizes)]
    assert_same([Padded(h0, sizes[:1]), Padded(out0, sizes[1:])], [Padded(h1, sizes[:1]), Padded(out1, sizes[1:])])


def test_an_empty_invoke_reading_the_result_gets_every_position(models, head_rows):
    def scenario(model):
        with model.trace() as tracer:
            with tracer.invoke(A):
                h = model.model.layers[1].output.save()
            with tracer.invoke():
                result = tracer.result.logits.save()
        return h, result

    (h0, r0), (h1, r1) = both(models, scenario)
    sizes = lengths(models, A)
    assert head_rows == [sum(sizes)]
    assert_same([Padded(h0, sizes), Padded(r0, sizes)], [Padded(h1, sizes), Padded(r1, sizes)])


def test_model_logits_in_a_trace_are_hfs_last_row(models, head_rows):
    oracle, ours = models
    with oracle.trace(B):
        expected = oracle.lm_head.output[:, -1].save()  # [1, V]
    with ours.trace(B):
        h = ours.model.layers[0].output.save()
        logits = ours.logits.save()
    assert h.shape[1] == n_tokens(ours.tokenizer, B)
    assert head_rows == [n_tokens(ours.tokenizer, B)]  # parked on the step's sampling: kept whole, as before
    assert_close_packed(logits, expected, rel=1e-4, msg="model.logits")


def test_a_logit_lens_call_of_the_head_sees_every_position_and_the_forwards_call_is_cut(models, head_rows):
    def scenario(model):
        with model.trace(C):
            hidden = model.model.layers[1].output
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            lens = model.lm_head(model.model.norm(hidden)).save()
        return lens

    expected, actual = both(models, scenario)
    size = n_tokens(models[1].tokenizer, C)
    assert head_rows == [size, 1]  # the block's own call, then the forward's on the sampled row
    assert_same(Padded(expected, [size]), Padded(actual, [size]))


def test_prompt_logprobs_in_a_traced_step_keep_every_position(models, head_rows):
    """A prompt-logprobs request in the same step as a trace that reads a layer: the head runs on every row."""
    oracle, ours = models
    prompt = ours.tokenizer(A)["input_ids"]
    params = nnrun.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    traced: dict = {}

    def trace() -> None:
        with ours.trace(C):
            traced["h"] = ours.model.layers[1].output.save()

    thread = threading.Thread(target=trace, daemon=True)
    with ours.engine.paused():  # both requests enter the same step
        thread.start()
        deadline = time.monotonic() + WAIT_S
        while ours.engine.num_requests_in_flight < 1:
            assert time.monotonic() < deadline, "the trace did not submit its request"
            time.sleep(0.005)
        handle = ours.engine.submit(prompt, params)
    output = handle.result(WAIT_S)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert head_rows == [len(prompt) + n_tokens(ours.tokenizer, C)]
    with torch.no_grad():
        expected = torch.log_softmax(oracle._module(torch.tensor([prompt])).logits[0], dim=-1)  # [T, V]
    got = torch.tensor([entry[token] for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])])
    want = torch.tensor([expected[i, token].item() for i, token in enumerate(prompt[1:])])
    assert_close_packed(got, want, rel=1e-4, msg="prompt logprobs")
    with oracle.trace(C):
        h = oracle.model.layers[1].output.save()
    assert_same(h, traced["h"])
