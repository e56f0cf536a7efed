"""nnsight 0.8.1's new name: code spelled `TransformersModel(..., task="text-generation")` runs on nnrun as on nnsight."""

from __future__ import annotations

import warnings

import pytest

from conformance.compare import assert_scenario_same
from conformance.models import tiny_llama, tiny_tokenizer, twin

# One scenario of each kind: reads, writes, invokes, generation, gradients, skip.
SCENARIOS = [
    "save_layer_outputs",
    "model_output_and_result",
    "zero_mlp",
    "activation_patching",
    "iter_over_generated_tokens",
    "gradient_of_loss",
    "skip_layer",
]


@pytest.fixture(scope="module")
def models():
    import nnsight

    import nnrun

    tokenizer = tiny_tokenizer()
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = nnsight.TransformersModel(twin(model), tokenizer=tokenizer, task="text-generation")
    ours = nnrun.TransformersModel(model, tokenizer=tokenizer, task="text-generation")
    yield oracle, ours, tokenizer
    ours.shutdown()


def test_the_new_name_is_the_language_model():
    import nnrun

    assert nnrun.TransformersModel is nnrun.LanguageModel
    assert "TransformersModel" in nnrun.__all__


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_spelled_the_new_way_matches_nnsight(models, name):
    oracle, ours, tokenizer = models
    assert_scenario_same(name, oracle, ours, tokenizer)
