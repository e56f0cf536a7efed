"""nnsight conformance: every scenario saves the same values on nnrun as nnsight does on plain HF."""

from __future__ import annotations

import pytest

from conformance.compare import assert_scenario_same
from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin
from conformance.scenarios import SCENARIOS


@pytest.fixture(scope="module")
def models():
    import nnrun

    tokenizer = tiny_tokenizer()
    model = tiny_llama()
    oracle = hf_language_model(twin(model), tokenizer)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer)
    yield oracle, ours, tokenizer
    ours.shutdown()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_matches_nnsight_on_hf(models, name):
    oracle, ours, tokenizer = models
    assert_scenario_same(name, oracle, ours, tokenizer)


def test_suite_is_large_enough():
    assert len(SCENARIOS) >= 25
