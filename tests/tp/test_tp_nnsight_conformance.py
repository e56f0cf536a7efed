"""nnsight conformance on two tensor-parallel ranks: every scenario saves what nnsight saves on plain HF.

The same scenarios as tests/test_interleaver_conformance.py (saves, edits, skips, patching across
invokes, the logit lens, generation with `tracer.iter`/`all`, sampled tokens), on a tiny GQA Llama
saved to a folder and loaded over two ranks; the oracle is nnsight on the plain HF model in this process.
"""

from __future__ import annotations

import warnings

import pytest

from conformance.compare import assert_same, assert_scenario_same
from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin
from conformance.scenarios import SCENARIOS
from interleaver.tp_fragments import SplitValueError


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import nnrun

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = tiny_tokenizer()
    model = tiny_llama()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    oracle = hf_language_model(twin(model), tokenizer)
    ours = nnrun.LanguageModel(str(folder), tensor_parallel_size=2, tensor_parallel_timeout=60)
    yield oracle, ours, tokenizer
    ours.shutdown()


# What two ranks refuse by name instead of serving a different value (each checked below).
REFUSED = {
    "gradient_of_loss": (NotImplementedError, r"gradients .* not served on tensor-parallel ranks"),
    "source_attention_interface": (SplitValueError, r"values inside model\.model\.layers\.1\.self_attn's forward"),
}


@pytest.mark.parametrize("name", sorted(set(SCENARIOS) - set(REFUSED)))
def test_scenario_matches_nnsight_on_hf(models, name):
    oracle, ours, tokenizer = models
    assert_scenario_same(name, oracle, ours, tokenizer)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_ranks_cannot_serve_is_refused_by_name(models, name):
    _, ours, tokenizer = models
    error, message = REFUSED[name]
    with warnings.catch_warnings(), pytest.raises(error, match=message):
        warnings.simplefilter("ignore")
        SCENARIOS[name](ours, tokenizer)
    assert_same(
        SCENARIOS["save_layer_outputs"](models[0], tokenizer), SCENARIOS["save_layer_outputs"](ours, tokenizer), "after"
    )
