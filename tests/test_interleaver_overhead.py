"""The bridge's per-trace shortcuts keep nnsight's semantics: each is checked against nnsight on HF or by hand."""

from __future__ import annotations

import ast
import warnings

import pytest
import torch

from conformance.compare import assert_same
from conformance.models import oracle_and_nnrun, tiny_llama, tiny_tokenizer
from interleaver.batcher import PackedBatcher
from interleaver.jobs import Invocation, TraceJob
from interleaver.mediator import PackedInterleaver, PackedMediator
from interleaver.tracer import _asks_for_grad

CLEAN = "the eiffel tower is in the city of"
CORRUPT = "the colosseum tower is in the city of"


@pytest.fixture(scope="module")
def models():
    oracle, ours = oracle_and_nnrun(tiny_llama(seed=3), tiny_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield oracle, ours
    ours.shutdown()


def sweep(model) -> list:
    """A patching sweep in one trace: the same corrupted prompt invoked once per position."""
    with torch.no_grad():
        with model.trace() as tracer:
            diffs = list().save()
            with tracer.invoke(CLEAN):
                source = model.model.layers[1].output.clone()
            for position in range(4):
                with tracer.invoke(CORRUPT):
                    hidden = model.model.layers[1].output
                    hidden[:, position] = source[:, position]
                    logits = model.lm_head.output[0, -1]
                    diffs.append(logits[5] - logits[6])
    return diffs


def test_a_prompt_invoked_many_times_is_tokenized_once_per_trace_with_hfs_results(models, monkeypatch):
    oracle, ours = models
    tokenized = []
    original = type(ours)._invoke_prompts

    def counting(self, kind, inputs, kwargs):
        tokenized.append(inputs)
        return original(self, kind, inputs, kwargs)

    monkeypatch.setattr(type(ours), "_invoke_prompts", counting)
    assert_same(sweep(oracle), sweep(ours))
    assert tokenized == [(CLEAN,), (CORRUPT,)]
    sweep(ours)  # the next trace tokenizes again: the tokenizer may have changed in between
    assert len(tokenized) == 4


def test_a_value_saved_by_name_and_in_the_traces_list_stays_one_object_as_on_hf(models):
    results = {}
    for name, model in zip(("hf", "nnrun"), models):
        with torch.no_grad():
            with model.trace() as tracer:
                saved = list().save()
                with tracer.invoke(CLEAN):
                    first = model.model.layers[0].output.save()
                    saved.append(first)
                with tracer.invoke(CORRUPT):
                    second = model.model.layers[2].output.save()
                    saved.append(second)
        assert saved[0] is first and saved[1] is second, name
        results[name] = saved
    assert_same(results["hf"], results["nnrun"])
    assert all(value._base is None for value in results["nnrun"])  # copies, not views of the step's tensor


def test_tracer_result_of_several_invokes_is_hfs(models):
    results = {}
    for name, model in zip(("hf", "nnrun"), models):
        with torch.no_grad():
            with model.trace() as tracer:
                with tracer.invoke([CLEAN, "the cat sat"]):
                    pass
                with tracer.invoke(CORRUPT):
                    result = tracer.result.save()
        results[name] = result
    assert_same(results["hf"], results["nnrun"])
    assert type(results["hf"]) is type(results["nnrun"])


def test_a_visit_nobody_waits_for_is_counted_without_touching_the_batcher():
    interleaver = PackedInterleaver(PackedBatcher(None))
    interleaver.batcher.location = "before"
    value = torch.zeros(1, 3, 2)
    assert interleaver.handle("model.model.layers.0.output", value) is value
    assert interleaver.handle("model.model.layers.0.output", value) is value
    assert interleaver.counts["model.model.layers.0.output"] == 2
    assert interleaver.batcher.location == "before"


def test_a_jobs_request_index_follows_replaced_invocations():
    block = compile("pass\n", "<block>", "exec")
    first = Invocation(PackedMediator(block, {}, {}), ["a"], 0)
    both = Invocation(PackedMediator(block, {}, {}), ["a", "b"], 1)
    job = TraceJob("trace", [first, both])
    assert job.invocations_of("a") == [first, both] and job.invocations_of("b") == [both]
    registered = Invocation(PackedMediator(block, {}, {}), ["b"], -1, job=job)
    job.invocations = [registered] + job.invocations  # as the serve layer attaches its registered edits
    assert job.invocations_of("b") == [registered, both] and job.invocations_of("c") == []


def test_whether_a_block_asks_for_gradients_is_remembered_on_its_node():
    asking, quiet = ast.parse("loss.backward()"), ast.parse("x = y.output")
    assert _asks_for_grad(asking) and asking._nnrun_asks_for_grad and _asks_for_grad(asking)
    assert not _asks_for_grad(quiet) and not _asks_for_grad(None)


def two_readers(model) -> dict:
    """Two invokes over a generation: one reads layer 0's output every step, the other layer 1's."""
    with torch.no_grad():
        with model.generate(max_new_tokens=3, do_sample=False) as tracer:
            first, second = list().save(), list().save()
            with tracer.invoke(CLEAN):
                for _ in tracer.all():
                    first.append(model.model.layers[0].output)
            with tracer.invoke(CORRUPT):
                for _ in tracer.all():
                    second.append(model.model.layers[1].output)
    return {"first": list(first), "second": list(second)}


def test_a_visit_serves_only_the_blocks_parked_on_it_with_hfs_values(models, monkeypatch):
    """A module's visit hands its value to the blocks waiting on that module and never wakes another's:
    the engine asks each block's mediator only at the locations it waits on, and the reads are HF's."""
    oracle, ours = models
    asked: list[tuple[int, str]] = []
    handle = PackedMediator.handle

    def counting(self, provider, value):
        asked.append((id(self), provider))
        return handle(self, provider, value)

    monkeypatch.setattr(PackedMediator, "handle", counting)
    results = {"hf": two_readers(oracle), "nnrun": two_readers(ours)}
    assert_same(results["hf"], results["nnrun"])
    asked = [(block, provider) for block, provider in asked if provider.startswith("model.model.")]  # module visits
    by_block: dict[int, set[str]] = {}
    for block, provider in asked:
        by_block.setdefault(block, set()).add(provider)
    assert sorted(map(sorted, by_block.values())) == [
        ["model.model.layers.0.output"],
        ["model.model.layers.1.output"],
    ]
    assert len(asked) == 2 * 3  # each block, once a step
