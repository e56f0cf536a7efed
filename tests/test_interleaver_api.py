"""nnrun-only parts of the API, each against nnsight on HF where it has an equivalent."""

from __future__ import annotations

import warnings

import pytest
import torch

from conformance.compare import assert_same
from conformance.models import oracle_and_nnrun, tiny_llama, tiny_tokenizer

PROMPT = "the eiffel tower is in the city of"


@pytest.fixture(scope="module")
def models():
    oracle, ours = oracle_and_nnrun(tiny_llama(seed=7), tiny_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield oracle, ours
    ours.shutdown()


def test_model_logits_are_the_next_token_logits_of_each_step(models):
    oracle, ours = models
    with oracle.generate(PROMPT, max_new_tokens=3) as tracer:
        expected = list().save()
        for step in tracer.iter[:3]:
            expected.append(oracle.lm_head.output[:, -1])
    with ours.generate(PROMPT, max_new_tokens=3) as tracer:
        actual = list().save()
        for step in tracer.iter[:3]:
            actual.append(ours.logits)
    assert_same(expected, actual)


def test_assigning_samples_forces_the_tokens(models):
    _, ours = models
    with ours.generate(PROMPT, max_new_tokens=3) as tracer:
        for step in tracer.iter[:2]:
            ours.samples = torch.full_like(ours.samples, 42)
        ids = tracer.result.save()
    assert ids[0, -3:-1].tolist() == [42, 42]


def test_editing_logits_changes_the_sample(models):
    _, ours = models
    with ours.generate(PROMPT, max_new_tokens=1) as tracer:
        ours.logits[:, 17] = 1e4
        ids = tracer.result.save()
    assert ids[0, -1].item() == 17


def test_next_moves_to_the_following_generation_step(models):
    oracle, ours = models
    with oracle.generate(PROMPT, max_new_tokens=3) as tracer:
        expected = list().save()
        for step in tracer.iter[:3]:
            expected.append(oracle.model.layers[0].output)
    with ours.generate(PROMPT, max_new_tokens=3) as tracer:
        h0 = ours.model.layers[0].output.save()
        tracer.next()
        h1 = ours.model.layers[0].output.save()
        tracer.next()
        h2 = ours.model.layers[0].output.save()
    assert_same(expected, [h0, h1, h2])


def test_plain_generate_returns_the_token_ids_hf_generates(models):
    oracle, ours = models
    expected = oracle.generate(PROMPT, max_new_tokens=4)
    assert torch.equal(ours.generate(PROMPT, max_new_tokens=4), expected)


def test_list_invoke_generation_pads_like_hf(models):
    oracle, ours = models
    prompts = ["the cat sat on the mat", "big ben"]
    for model in (oracle, ours):
        with model.generate(max_new_tokens=2) as tracer:
            with tracer.invoke(prompts):
                hidden = list().save()
                for step in tracer.iter[:2]:
                    hidden.append(model.model.layers[1].output[:, -1])
                ids = tracer.result.save()
        if model is oracle:
            expected = (hidden, ids)
    assert_same(expected[0], hidden)
    assert torch.equal(ids, expected[1])


def test_unsupported_keywords_are_refused(models):
    _, ours = models
    with pytest.raises(TypeError, match="num_beams"):
        ours.generate(PROMPT, num_beams=2)


def test_stop_ends_only_that_generation_and_keeps_its_saves(models):
    _, ours = models
    with ours.generate(max_new_tokens=5) as tracer:
        with tracer.invoke(PROMPT):
            hidden = list().save()
            for step in tracer.iter[:5]:
                hidden.append(ours.model.layers[0].output)
                if step == 1:
                    tracer.stop()
        with tracer.invoke("big ben is in"):
            other = tracer.result.save()
    # The other prompt ran its 5 tokens; its ids are left-padded to the trace's longest prompt (8), as HF pads a batch.
    assert len(hidden) == 2 and other.shape == (1, 8 + 5) and other[0, -5:].ne(0).all()
    requests = [r for r in ours.engine.core.scheduler.running]
    assert not requests


def test_a_skip_in_one_invoke_leaves_the_others_running_the_module(models):
    oracle, ours = models
    expected = []
    for text, skips in ((PROMPT, True), ("big ben is in", False)):
        with oracle.trace(text):
            if skips:
                oracle.model.layers[1].skip(oracle.model.layers[1].input)
            expected.append(oracle.lm_head.output.save())
    with ours.trace() as tracer:
        with tracer.invoke(PROMPT):
            ours.model.layers[1].skip(ours.model.layers[1].input)
            skipped = ours.lm_head.output.save()
        with tracer.invoke("big ben is in"):
            ran = ours.lm_head.output.save()
    assert_same(expected, [skipped, ran])


def test_saved_values_hold_only_their_own_request(models):
    _, ours = models
    with ours.generate(max_new_tokens=2) as tracer:
        per_step = list().save()
        with tracer.invoke(PROMPT):
            hidden = ours.model.layers[0].output.save()
            for step in tracer.iter[:2]:
                per_step.append(ours.model.layers[1].output)
        with tracer.invoke("big ben is in the city"):
            logits = ours.logits.save()
    for value in [hidden, logits, *per_step]:
        assert value._base is None and value.untyped_storage().nbytes() == value.numel() * value.element_size()


def test_hf_generate_keywords_map_onto_the_engine_sampling(models):
    _, ours = models
    greedy = ours._sampling_params("generate", {"max_new_tokens": 3, "temperature": 0.7}, prompt_len=5)
    assert greedy.is_greedy and greedy.max_tokens == 3  # as HF: temperature without do_sample is ignored
    sampled = ours._sampling_params(
        "generate", {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.2}, prompt_len=5
    )
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.repetition_penalty) == (0.7, 0.9, 50, 1.2)
    assert sampled.max_tokens == 20  # HF's defaults for what the model's config leaves unset: top_k 50, 20 new tokens
    with ours.generate(PROMPT, max_new_tokens=4, do_sample=True, top_k=5, seed=3) as tracer:
        first = tracer.result.save()
    with ours.generate(PROMPT, max_new_tokens=4, do_sample=True, top_k=5, seed=3) as tracer:
        second = tracer.result.save()
    assert torch.equal(first, second)
