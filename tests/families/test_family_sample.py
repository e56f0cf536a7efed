"""The family sweep's representative sample (fast tier): each family exact against HF, or refused by name."""

from __future__ import annotations

import pytest

from families.sweep import check_family

# One family per way a model can meet nnrun: attention on transformers' interface (llama), attention
# sinks (gpt_oss), attention outside the interface routed by nnrun/attention/classic (gptj), positions
# numbered from an offset
# (roberta); below, a state-space model (mamba) and a hybrid of linear attention and attention
# (qwen3_next), both packed over the state pool; a recurrent model the state pool does not serve
# (rwkv keeps its own `state`) and a hybrid whose recurrent block is its own code (recurrent_gemma),
# both exact; and a model whose own HF forward fails without a setting a user must make first
# (xmod's language), each with what it must say.
SAMPLE = ("llama", "gpt_oss", "gptj", "roberta")


@pytest.mark.parametrize("model_type", SAMPLE)
def test_family_is_exact_or_refused_by_name(model_type):
    result = check_family(model_type)  # raises if nnrun's numbers differ from HF's
    assert result.path in ("packed", "exact", "refused"), f"{model_type}: {result.path} ({result.detail})"
    if result.path == "refused":
        assert model_type in result.detail


def test_a_state_space_model_runs_packed_over_the_state_pool():
    assert check_family("mamba").path == "packed"


def test_a_model_without_attention_the_state_pool_does_not_serve_runs_exact_instead_of_crashing():
    result = check_family("rwkv")
    assert result.path == "exact"
    assert "no layer calls transformers' attention interface" in result.detail


def test_a_model_whose_own_forward_fails_is_refused_naming_family_and_reason():
    result = check_family("xmod")
    assert result.path == "refused"
    assert "xmod" in result.detail and "Input language unknown" in result.detail


def test_a_hybrid_of_linear_attention_and_attention_runs_packed():
    assert check_family("qwen3_next").path == "packed"


def test_a_hybrid_the_state_pool_does_not_serve_runs_exact_with_the_right_reason():
    result = check_family("recurrent_gemma")  # its recurrent block keeps no state in HF's cache API
    assert result.path == "exact"
    assert "do not call transformers' attention interface (state-space, linear-attention" in result.detail
    assert "shared-KV" not in result.detail
