"""nnsight traces on two tensor-parallel ranks (tiny-facts, a GQA Llama with tied embeddings).

Oracles: nnsight on the plain HF model for values, nnrun on one rank for sampled tokens; run to run,
the same trace gives bitwise the same values whatever else shares its steps.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import pytest
import torch

import nnrun
from nnrun.tp import TensorParallelError
from tolerance import assert_close_packed

pytestmark = pytest.mark.slow

A, B = "The capital of France is", "Water boils at"


@pytest.fixture(scope="module")
def tp2():
    model = nnrun.LanguageModel("tiny-facts", tensor_parallel_size=2, tensor_parallel_timeout=60)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def oracle():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import nnsight

    path = nnrun.bundled_model_path("tiny-facts")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nnsight.LanguageModel(
            AutoModelForCausalLM.from_pretrained(path).eval(), tokenizer=AutoTokenizer.from_pretrained(path)
        )


def _patching(model):
    """Reads of a column-sharded projection, of a value between sharded projections and of the residual
    stream, and a patch from one invoke into another (last positions: nnsight on HF pads the invokes)."""
    with model.trace() as tracer:
        with tracer.invoke(A):
            q = model.model.layers[0].self_attn.q_proj.output[:, -1].save()
            gate = model.model.layers[2].mlp.act_fn.output[:, -1].save()
            clean = model.model.layers[2].output[:, -1].clone().save()
        with tracer.invoke(B):
            hidden = model.model.layers[2].output
            hidden[:, -1] = clean
            patched = model.lm_head.output[:, -1].save()
    return {"q": q, "clean": clean, "gate": gate, "patched": patched}


def test_reads_and_patches_equal_nnsight_on_hf(tp2, oracle):
    ours, theirs = _patching(tp2), _patching(oracle)
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, name  # whole tensors, not one rank's piece
        assert_close_packed(ours[name], theirs[name], msg=name)


def test_values_are_bitwise_the_same_run_to_run_and_beside_other_traces(tp2):
    alone = _patching(tp2)
    again = _patching(tp2)
    beside: dict = {}

    def other_trace():
        with tp2.trace("Paris is the capital of"):
            tp2.model.layers[1].mlp.output[:] = 0
            logits = tp2.lm_head.output.save()
        beside["logits"] = logits  # (a block runs on the ranks: only saved values come back here)

    for _ in range(3):  # a second trace in flight changes how the steps are packed, never the values
        thread = threading.Thread(target=other_trace)
        thread.start()
        shared = _patching(tp2)
        thread.join(60)
        for name in alone:
            assert torch.equal(shared[name], alone[name]), name
    for name in alone:
        assert torch.equal(again[name], alone[name]), name
    assert beside["logits"].shape[-1] == alone["patched"].shape[-1]


def test_generation_with_interventions_matches_one_rank(tp2):
    one = nnrun.LanguageModel("tiny-facts")
    try:
        results = []
        for model in (tp2, one):
            with model.generate(
                A, max_new_tokens=6, min_new_tokens=6, do_sample=True, temperature=0.8, seed=7
            ) as tracer:
                for _ in tracer.iter[:6]:
                    model.model.layers[1].mlp.output[:] *= 0.5
                ids = tracer.result.save()
            results.append(ids)
        assert torch.equal(results[0], results[1])  # one sampler (rank 0) with the request's own seed
    finally:
        one.shutdown()


def test_a_block_that_raises_ends_only_its_own_trace(tp2, oracle):
    expected = _patching(oracle)
    outcome: dict = {}

    def good():
        outcome["values"] = _patching(tp2)

    thread = threading.Thread(target=good)
    thread.start()
    with pytest.raises(ZeroDivisionError):
        with tp2.trace(A):
            tp2.model.layers[1].output.save()
            1 / 0
    thread.join(60)
    for name in expected:
        assert_close_packed(outcome["values"][name], expected[name], msg=name)
    with pytest.raises(ValueError, match="shape"):  # a write of the wrong shape: refused, the engine goes on
        with tp2.trace(B):
            tp2.model.layers[1].mlp.output = torch.zeros(3)
    assert torch.equal(_patching(tp2)["patched"], outcome["values"]["patched"])


def test_gradients_are_refused_by_name(tp2):
    with pytest.raises(NotImplementedError, match="gradients .* not served on tensor-parallel ranks"):
        with tp2.trace(A):
            hidden = tp2.model.layers[1].output
            hidden.retain_grad()
            tp2.lm_head.output.sum().backward()


def test_attention_probabilities_have_every_head_as_on_one_rank(tp2):
    # One rank's probabilities are HF eager's (tests/test_attention_patterns.py); two ranks gather their heads.
    one = nnrun.LanguageModel("tiny-facts")
    try:
        probs = []
        for model in (tp2, one):
            with model.trace() as tracer:
                with tracer.invoke(A, output_attentions=True):
                    first = model.model.layers[0].self_attn.output[1].save()
                with tracer.invoke(B):  # asks for none: its requests' rows cost nothing
                    model.model.layers[0].self_attn.output.save()
            probs.append(first)
        assert probs[0].shape == probs[1].shape == (1, 4, 6, 6)
        assert_close_packed(probs[0], probs[1], msg="layer 0 probabilities")
    finally:
        one.shutdown()


def test_vllm_spelling_runs_on_ranks():
    tp = nnrun.VLLM("tiny-facts", tensor_parallel_size=2, tensor_parallel_timeout=60)
    one = nnrun.VLLM("tiny-facts")
    try:
        values = []
        for model in (tp, one):
            with model.trace(A, temperature=0.0, max_tokens=3):
                logits = model.logits.save()
                samples = model.samples.save()
            values.append((logits, samples))
        assert torch.equal(values[0][1], values[1][1])
        assert_close_packed(values[0][0], values[1][0], msg="logits")
    finally:
        tp.shutdown()
        one.shutdown()


def test_a_killed_rank_fails_a_waiting_trace_within_its_timeout():
    model = nnrun.LanguageModel("tiny-facts", tensor_parallel_size=2, tensor_parallel_timeout=30)
    pids = [p.pid for p in model.engine.runner.group.processes]
    try:
        killer = threading.Timer(2.0, os.kill, (pids[1], signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by signal SIGKILL"):
            with model.generate(A, max_new_tokens=150, min_new_tokens=150) as tracer:
                for _ in tracer.all():  # each step's block waits a little (on every rank): the trace is still running
                    model.model.layers[0].output.save()
                    time.sleep(0.05)
        assert time.monotonic() - start < 30
    finally:
        model.shutdown()


def test_untraced_generation_beside_traces_gives_one_rank_tokens(tp2):
    # Plain steps on the nnsight ranks (no block in them): the rank path without any intervention.
    one = nnrun.LanguageModel("tiny-facts")
    try:
        assert torch.equal(tp2.generate(A, max_new_tokens=5), one.generate(A, max_new_tokens=5))
    finally:
        one.shutdown()
