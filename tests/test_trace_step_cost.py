"""A trace costs only what it touches: steps no block can read or write run as untraced steps.

On CPU with the CUDA-graph stand-in (tests/fake_cuda_graph.py) and the FlashInfer emulator: a
generation whose blocks have finished, or wait only for the trace's end, replays its decode graphs
and gives bitwise the tokens of an untraced generation; a block that reads every step still sees
every step eagerly, with nnsight on HF's values; and a block parked on a step's sampling still reads
the module step it asks for.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import nnrun
from conformance.models import oracle_and_nnrun, tiny_llama, tiny_tokenizer
from fake_flashinfer import make_fake_flashinfer
from test_cuda_graphs import capture_graphs, count_decode_steps, greedy_params

P = "the eiffel tower is in the city of"  # 8 tokens
Q = "hello world"
NEW_TOKENS = 5


@pytest.fixture
def graphed(monkeypatch):
    """nnsight on HF (the oracle), and nnrun with decode graphs captured by the stand-in; its step counts."""
    monkeypatch.setitem(sys.modules, "flashinfer", make_fake_flashinfer())
    oracle, ours = oracle_and_nnrun(tiny_llama(seed=3), tiny_tokenizer())
    capturer = capture_graphs(ours.engine)
    counts = count_decode_steps(ours.engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield oracle, ours, counts, capturer
    ours.shutdown()


def untraced_tokens(ours, prompts: list[str]) -> list[list[int]]:
    ids = [ours.tokenizer(text)["input_ids"] for text in prompts]
    return [o.outputs[0].token_ids for o in ours.engine.generate(ids, greedy_params(NEW_TOKENS))]


def generated_rows(ids: torch.Tensor, prompts: list[str], tokenizer) -> list[list[int]]:
    """The new tokens of each row of left-padded generated ids `[B, T_max + new]`."""
    return [row[-NEW_TOKENS:].tolist() for row in ids]


def test_a_trace_with_nothing_inside_replays_every_decode_step(graphed):
    _, ours, counts, capturer = graphed
    expected = untraced_tokens(ours, [P, Q])
    before = dict(counts)
    with ours.generate(max_new_tokens=NEW_TOKENS) as tracer:
        with tracer.invoke(P):
            pass
        with tracer.invoke(Q):
            pass
        with tracer.invoke():  # parked on the trace's end: it touches no step
            result = tracer.result.save()
    assert counts["replayed"] - before["replayed"] == NEW_TOKENS - 1
    assert counts["eager"] == before["eager"]
    assert generated_rows(result, [P, Q], ours.tokenizer) == expected


def test_a_block_that_read_only_the_prompt_replays_the_decode_steps(graphed):
    oracle, ours, counts, _ = graphed
    expected_tokens = untraced_tokens(ours, [P])

    def scenario(model):
        with model.generate(P, max_new_tokens=NEW_TOKENS) as tracer:
            hidden = model.model.layers[1].output.save()
            ids = tracer.result.save()
        return hidden, ids

    before = dict(counts)
    hidden, ids = scenario(ours)
    assert counts["replayed"] - before["replayed"] == NEW_TOKENS - 1 and counts["eager"] == before["eager"]
    assert ids[0, -NEW_TOKENS:].tolist() == expected_tokens[0]
    oracle_hidden, oracle_ids = scenario(oracle)
    torch.testing.assert_close(hidden, oracle_hidden, atol=1e-5, rtol=1e-5)
    assert torch.equal(ids.cpu(), oracle_ids.cpu())


def test_a_block_reading_every_step_sees_each_step_eagerly_with_hfs_values(graphed):
    oracle, ours, counts, _ = graphed

    def scenario(model):
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            hidden = list().save()
            with tracer.invoke(P):
                for _ in tracer.all():
                    hidden.append(model.model.layers[1].output[0, -1])
            with tracer.invoke(Q):
                pass
        return torch.stack(list(hidden))  # [steps, H]

    before = dict(counts)
    ours_hidden = scenario(ours)
    assert counts["eager"] - before["eager"] == NEW_TOKENS - 1 and counts["replayed"] == before["replayed"]
    assert ours_hidden.shape[0] == NEW_TOKENS
    torch.testing.assert_close(ours_hidden, scenario(oracle), atol=1e-5, rtol=1e-5)


def test_a_block_parked_on_sampling_still_reads_the_module_step_it_asks_for(graphed):
    """A block parked on `model.logits` may read the next steps' modules by their visit counts: such
    steps stay traced, so `tracer.iter[3]` is the fourth forward, as on HF."""
    oracle, ours, _, _ = graphed
    with ours.generate(P, max_new_tokens=NEW_TOKENS) as tracer:
        logits = ours.logits.save()
        for _ in tracer.iter[3:4]:
            hidden = ours.model.layers[1].output.save()
    with oracle.generate(P, max_new_tokens=NEW_TOKENS) as tracer:
        oracle_logits = oracle.lm_head.output[:, -1].save()
        for _ in tracer.iter[3:4]:
            oracle_hidden = oracle.model.layers[1].output.save()
    torch.testing.assert_close(logits, oracle_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, oracle_hidden, atol=1e-5, rtol=1e-5)


def test_steering_every_step_then_an_untraced_generation_replays_again(graphed):
    oracle, ours, counts, _ = graphed
    vector = torch.linspace(-1.0, 1.0, 64)

    def scenario(model):
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            with tracer.invoke(P):
                for _ in tracer.all():
                    model.model.layers[1].output[:] += vector
            with tracer.invoke():
                ids = tracer.result.save()
        return ids

    assert torch.equal(scenario(ours).cpu(), scenario(oracle).cpu())
    before = dict(counts)
    ours.engine.generate([ours.tokenizer(Q)["input_ids"]], greedy_params(NEW_TOKENS))
    assert counts["replayed"] - before["replayed"] == NEW_TOKENS - 1
    ours.engine.runner.allocator.check_no_leaks()


def test_no_graphs_untraced_and_traced_with_nothing_give_the_same_tokens():
    """Without graphs (the CPU default) the unwatched step runs the plain forward: the same tokens."""
    model = nnrun.LanguageModel(tiny_llama(seed=5), tokenizer=tiny_tokenizer())
    try:
        expected = untraced_tokens(model, [P, Q])
        with model.generate([P, Q], max_new_tokens=NEW_TOKENS) as tracer:
            result = tracer.result.save()
        assert generated_rows(result, [P, Q], model.tokenizer) == expected
    finally:
        model.shutdown()


def test_a_traces_prompts_under_the_same_settings_are_sampled_as_one_batch(monkeypatch):
    """Prompts of different lengths under the same settings hold one SamplingParams, as `engine.generate`'s do:
    the runner samples them in whole-batch ops, not row by row; an invoke's own settings stay its own."""
    model = nnrun.LanguageModel(tiny_llama(seed=5), tokenizer=tiny_tokenizer())
    runner = model.engine.runner
    sampled_row_by_row = []
    row_by_row = type(runner.sampler).__call__
    monkeypatch.setattr(
        type(runner.sampler), "__call__", lambda self, *a: sampled_row_by_row.append(1) or row_by_row(self, *a)
    )
    jobs = []
    build_job = type(model)._build_job
    monkeypatch.setattr(type(model), "_build_job", lambda self, *a: jobs.append(build_job(self, *a)) or jobs[-1])
    try:
        expected = untraced_tokens(model, [P, Q])
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            with tracer.invoke(P):
                pass
            with tracer.invoke(Q):
                pass
            with tracer.invoke():
                result = tracer.result.save()
        assert generated_rows(result, [P, Q], model.tokenizer) == expected
        assert len({id(request.sampling_params) for request in jobs[0].requests.values()}) == 1
        assert not sampled_row_by_row
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            with tracer.invoke(P):
                pass
            with tracer.invoke(Q, max_new_tokens=2):
                pass
        first, second = (request.sampling_params for request in jobs[1].requests.values())
        assert (first.max_tokens, second.max_tokens) == (NEW_TOKENS, 2)
    finally:
        model.shutdown()
