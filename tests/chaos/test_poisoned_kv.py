"""Masked and padding positions contribute exactly nothing, whatever sits in the KV pool.

Every slot a request or a graph can write (free pages, the stale tail of a request's last page,
the trash page) is filled with NaN or inf before the engine runs: a request only ever writes
its own slots, so if attention reads nothing else, tokens and logprobs are bitwise those of a
clean pool. Run for the torch backend and for the FlashInfer backend over its CPU emulator.
"""

from __future__ import annotations

import sys

import pytest

import nnrun
from fake_flashinfer import make_fake_flashinfer
from model_zoo import make_model, random_prompts
from nnrun.attention.flashinfer_backend import FlashInferAttnBackend

FAMILIES = ["llama", "gemma2"]  # plain GQA; a sliding window with softcap (the float32 softmax path)
PARAMS = nnrun.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)


def poison(llm: nnrun.LLM, value: float) -> None:
    """Every page a request or a graph can write: the allocator's and the trash page (not the zero page)."""
    pool = llm.runner.kv_pool
    for pages in pool.k_pages + pool.v_pages:
        pages[: pool.zero_page].fill_(value)


def zero_page_is_zero(llm: nnrun.LLM) -> bool:
    pool = llm.runner.kv_pool
    return all(bool((pages[pool.zero_page] == 0).all()) for pages in pool.k_pages + pool.v_pages)


def run(family: str, backend: str, poison_value: float | None) -> list:
    """Steps driven by hand (no engine thread), so both runs pack exactly the same batches."""
    with nnrun.LLM(make_model(family), page_size=4, max_total_tokens=512) as llm:
        if backend == "flashinfer":
            runner = llm.runner
            runner.attn_backend = FlashInferAttnBackend(
                runner.kv_pool, runner.device, runner.layers, workspace_bytes=1 << 16
            )
        if poison_value is not None:
            poison(llm, poison_value)
        # The lowest pages, where padding rows point, are held as a finished request leaves them: stale.
        stale_pages = llm.runner.allocator.alloc(2)
        first = [llm.make_request(p, PARAMS) for p in random_prompts([3, 17, 9], seed=1)]
        second = [
            llm.make_request(p, PARAMS, request_id=f"late-{i}")
            for i, p in enumerate(random_prompts([21, 2, 6], seed=2))
        ]
        for req in first:
            llm.core.add_request(req)
        for _ in range(3):  # a prefill, then decode steps of mixed lengths (padding rows)
            llm.core.step()
        for req in second:  # joins while the first wave decodes: extend steps over cached prefixes
            llm.core.add_request(req)
        for _ in range(100):
            if not llm.core.has_unfinished:
                break
            llm.core.step()
        assert not llm.core.has_unfinished
        llm.runner.allocator.free(stale_pages)
        llm.runner.allocator.check_no_leaks()
        assert zero_page_is_zero(llm), "something wrote into the zero page that padding reads"
    return [(req.output_token_ids, req.output_logprobs) for req in first + second]


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("poison_value", [float("nan"), float("inf")])
def test_a_poisoned_pool_changes_no_token_and_no_logprob(monkeypatch, backend, family, poison_value):
    monkeypatch.setitem(sys.modules, "flashinfer", make_fake_flashinfer())
    clean = run(family, backend, None)
    assert run(family, backend, poison_value) == clean


def test_nan_left_in_freed_pages_by_a_trace_does_not_reach_later_requests(tiny_facts):
    """The issue's reproduction: a trace writes NaN over 120 tokens, whose pages are freed and reused."""
    model, solo = tiny_facts.model, tiny_facts.solo
    with model.trace([5] * 120):
        model.model.layers[1].output[:] = float("nan")
    prompts = ["The Colosseum is in", "The Eiffel Tower is in", "Paris"]
    outputs = model.engine.generate(prompts, tiny_facts.params)
    assert [o.outputs[0].token_ids for o in outputs] == [solo(p) for p in prompts]
    assert zero_page_is_zero(model.engine)
