"""The bridge on other architectures: reads, edits and generation match nnsight on HF."""

from __future__ import annotations

import copy
import warnings

import pytest

from conformance.compare import assert_same
from conformance.models import hf_language_model, tiny_tokenizer
from model_zoo import make_model


def layers_of(model, family):
    return model.transformer.h if family == "gpt2" else model.model.layers


def patch_and_generate(model, family):
    with model.trace() as tracer:
        with tracer.invoke("the eiffel tower is in the city of paris and rome"):
            first = layers_of(model, family)[0].output.save()
            second = layers_of(model, family)[1].output.save()
        with tracer.invoke("big ben is in"):
            hidden = layers_of(model, family)[1].output
            hidden[:, -1] = second[:, -1]
            logits = model.lm_head.output.save()
    with model.generate("the cat sat", max_new_tokens=3) as tracer:
        ids = tracer.result.save()
    return {"first": first, "second": second, "logits": logits[:, -4:], "ids": ids}


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "gemma2"])
def test_family_matches_nnsight_on_hf(family):
    import nnrun

    model = make_model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = hf_language_model(copy.deepcopy(model), tiny_tokenizer())
        ours = nnrun.LanguageModel(model, tokenizer=tiny_tokenizer())
        try:
            assert_same(patch_and_generate(oracle, family), patch_and_generate(ours, family), family)
        finally:
            ours.shutdown()
