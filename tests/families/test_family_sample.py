"""The family sweep's representative sample (fast tier): each family exact against HF, or refused by name."""

from __future__ import annotations

import pytest
import torch

import nnrun
from families.sweep import check_family
from families.test_exact_path import tiny_llama

# One family per way a model can meet nnrun: attention on transformers' interface (llama), attention
# sinks (gpt_oss), attention outside the interface routed by nnrun/attention/classic (gptj), positions
# numbered from an offset
# (roberta); below, a state-space model (mamba) and a hybrid of linear attention and attention
# (qwen3_next), both packed over the state pool, and a recurrent model keeping its state on the module
# (rwkv), packed too; a model whose attention is its own code nnrun does not route (xlnet) and a hybrid
# whose mixer nnrun does not know, both exact; and a model whose own HF forward fails without a setting
# a user must make first (xmod's language), each with what it must say.
SAMPLE = ("llama", "gpt_oss", "gptj", "roberta")


@pytest.mark.parametrize("model_type", SAMPLE)
def test_family_is_exact_or_refused_by_name(model_type):
    result = check_family(model_type)  # raises if nnrun's numbers differ from HF's
    assert result.path in ("packed", "exact", "refused"), f"{model_type}: {result.path} ({result.detail})"
    if result.path == "refused":
        assert model_type in result.detail


def test_a_state_space_model_runs_packed_over_the_state_pool():
    assert check_family("mamba").path == "packed"


def test_a_recurrent_model_keeping_its_state_on_the_module_runs_packed_over_the_state_pool():
    assert check_family("rwkv").path == "packed"


def test_a_model_whose_attention_is_its_own_code_runs_exact_instead_of_crashing():
    result = check_family("xlnet")
    assert result.path == "exact"
    assert "no layer calls transformers' attention interface" in result.detail


def test_a_model_whose_own_forward_fails_is_refused_naming_family_and_reason():
    result = check_family("xmod")
    assert result.path == "refused"
    assert "xmod" in result.detail and "Input language unknown" in result.detail


def test_a_hybrid_of_linear_attention_and_attention_runs_packed():
    assert check_family("qwen3_next").path == "packed"


class OwnMixer(torch.nn.Module):
    """A token mixer of a model's own code (a causal running mean), not on transformers' attention interface."""

    def forward(self, hidden_states, **kwargs):
        counts = torch.arange(1, hidden_states.shape[1] + 1, device=hidden_states.device)[None, :, None]
        return hidden_states.cumsum(dim=1) / counts, None


def test_a_hybrid_whose_mixer_the_state_pool_does_not_know_runs_exact_with_the_right_reason():
    model = tiny_llama()
    model.model.layers[0].self_attn = OwnMixer()  # every hybrid in transformers 5.23 is served; this one is not
    with nnrun.LLM(model) as llm:
        reason = llm.runner.exact_forward.reason
    assert "do not call transformers' attention interface (state-space, linear-attention" in reason
    assert "shared-KV" not in reason


def test_an_attention_block_shared_by_several_layers_runs_exact_with_the_reason():
    result = check_family("zamba")  # one attention module for all hybrid layers, told apart at call time
    assert result.path == "exact"
    assert "an attention module has no layer index of its own" in result.detail
