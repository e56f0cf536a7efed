"""nnsight's `rename=` aliases and `model.scan(...)` on nnrun, against nnsight on the plain HF model."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaAttention

import nnsight

from conformance.compare import assert_same
from conformance.models import tiny_llama, tiny_tokenizer, twin

PROMPT = "the eiffel tower is in the city of"
OTHER = "mary went to the store"

RENAME = {
    "model.layers": "layers",  # a path to a module list, bound on the root
    "lm_head": "unembed",  # one module
    "self_attn": ["attention", "attn"],  # a name found in every block, two aliases
    "mlp.down_proj": "mlp.out",  # a dotted alias, bound on the MLP
    LlamaAttention: "mixer",  # a module class
}


def _pair(rename: dict | None = RENAME):
    import nnrun

    tokenizer = tiny_tokenizer()
    model = tiny_llama(seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = nnsight.LanguageModel(twin(model), tokenizer=tokenizer, rename=rename)
    return oracle, nnrun.LanguageModel(model, tokenizer=tokenizer, rename=rename)


@pytest.fixture(scope="module")
def models():
    oracle, ours = _pair()
    yield oracle, ours
    ours.shutdown()


def _read_through_aliases(model) -> dict:
    with model.trace(PROMPT) as tracer:
        cache = tracer.cache(modules=[model.layers[1]]).save()
        attention = model.layers[0].attention.output[0].save()
        also_attention = model.model.layers[0].mixer.output[0].save()
        mlp_out = model.layers[0].mlp.out.output.save()
        model.layers[1].attn.output[0][:, -1] = 0  # an edit through an alias
        logits = model.unembed.output.save()
    return {
        "attention": attention,
        "also_attention": also_attention,
        "mlp_out": mlp_out,
        "logits": logits,
        "cached": cache["model.model.layers.1"].output,
        "cached_by_alias": cache.model.layers[1].output,
    }


def test_aliases_read_and_edit_as_on_hf(models):
    oracle, ours = models
    expected, actual = _read_through_aliases(oracle), _read_through_aliases(ours)
    assert_same(expected, actual)
    # The edit took effect: the logits differ from an unedited run.
    with ours.trace(PROMPT):
        clean = ours.unembed.output.save()
    assert not torch.allclose(clean, actual["logits"])


def test_aliases_are_the_same_envoys(models):
    _, ours = models
    assert ours.layers is ours.model.layers
    assert ours.layers[0].attention is ours.model.layers[0].self_attn is ours.layers[0].mixer
    assert "attention" in repr(ours.layers[0])  # printed with its aliases, as nnsight prints them


def test_an_alias_that_would_shadow_a_name_is_refused_as_on_hf():
    import nnrun

    rename = {"lm_head": "model"}  # `model` is already the backbone's name
    with pytest.raises(ValueError) as expected:
        nnsight.LanguageModel(tiny_llama(), tokenizer=tiny_tokenizer(), rename=rename)
    with pytest.raises(ValueError) as actual:
        nnrun.LanguageModel(tiny_llama(), tokenizer=tiny_tokenizer(), rename=rename)
    assert str(actual.value) == str(expected.value)


def _scan(model) -> dict:
    layer = model.model.layers[1]  # an envoy bound before the block
    with model.scan(PROMPT):
        hidden = nnsight.save(model.model.layers[0].output.shape)
        attention = nnsight.save(layer.self_attn.output[0].shape)
        dtype = nnsight.save(model.lm_head.output.dtype)
    with model.scan() as tracer:
        with tracer.invoke([PROMPT, OTHER]):
            pair = nnsight.save(model.layers[0].output.shape)
        with tracer.invoke(OTHER):
            single = nnsight.save(model.unembed.output.shape)
    return {"hidden": hidden, "attention": attention, "dtype": dtype, "pair": pair, "single": single}


def test_scan_gives_hf_shapes_without_running_the_engine(models):
    oracle, ours = models
    runner = ours.engine.runner
    calls = []
    run_model = runner.run_model
    runner.run_model = lambda *a, **k: calls.append(1) or run_model(*a, **k)
    try:
        actual = _scan(ours)
    finally:
        runner.run_model = run_model
    assert actual == _scan(oracle)
    assert actual["hidden"] == (1, 8, 64)
    assert calls == []
    # The model still traces normally afterwards, with real values.
    with ours.trace(PROMPT):
        out = ours.model.layers[0].output.save()
    assert out.shape == (1, 8, 64) and torch.isfinite(out).all()


def test_a_scan_error_names_the_block_line(models):
    _, ours = models
    with pytest.raises(AttributeError, match="no_such_module"):
        with ours.scan(PROMPT):
            ours.model.no_such_module.output.shape
