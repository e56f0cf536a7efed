"""Families in bf16 on CPU against HF's own bf16: 256- and 300-token prompts and decode steps, packed and alone,
within HF's own rounding, every token routed to HF's experts (families/half_precision.py)."""

from __future__ import annotations

import pytest

from families.half_precision import check_half_precision
from families.tiny import causal_lm_families

SAMPLE = ("llama", "qwen3_moe")  # RoPE, and an MoE on transformers' shared experts interface

# Families where nnrun's bf16 numbers are not yet HF's (issue 34): the packed path computes some term in another
# precision than HF's bf16 code, which the load-time probe's short prompts do not resolve. Largest log-prob error
# against HF alone at 256-300 tokens, where HF's own rounding (padded batch, cached decode) is 0-0.03.
# None at present: a family listed here by its figure is strict-xfailed until fixed.
NOT_YET_HFS: dict[str, str] = {}


def check(model_type: str) -> None:
    result = check_half_precision(model_type)  # raises if nnrun's numbers or routes are not HF's
    if result.path == "not built":
        pytest.skip(f"HF's own bf16 run of the tiny {model_type} fails: {result.detail}")
    if result.path == "refused":
        assert model_type in result.detail


@pytest.mark.parametrize("model_type", SAMPLE)
def test_family_in_bf16_gives_hfs_numbers_and_experts(model_type):
    result = check_half_precision(model_type)
    assert result.path == "packed" and max(result.errors.values()) <= result.bound
    assert result.num_routed_tokens > 0 or model_type == "llama"


@pytest.mark.slow  # every causal LM family in transformers, two long prompts each: 10 minutes on 2 idle cores (27 shared)
@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(name, marks=pytest.mark.xfail(reason=NOT_YET_HFS[name], strict=True))
        if name in NOT_YET_HFS
        else name
        for name in sorted(set(causal_lm_families()) - set(SAMPLE))
    ],
)
def test_every_family_in_bf16_gives_hfs_numbers_and_experts(model_type):
    check(model_type)
