"""Families whose attention module computes its core in a method `_attn(query, key, value, attention_mask)`.

GPT-J, GPT-Neo, CodeGen, GPT-NeoX-Japanese and OpenAI GPT: `forward` projects, splits heads and
applies rotary (from the `position_ids` it is given, the step's per-request positions), then calls
`self._attn` on `[B, H, T, D]` tensors (OpenAI GPT: keys as `[B, H, D, T]`), which returns
`(attn_output [B, H, T, D], attn_weights)` (OpenAI GPT: a list, the weights only when asked). Only
`_attn` is replaced on the instance; within a step it attends through the paged backend and returns
the probabilities slot the glue gives (None unless a request asked).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch

from nnrun.attention.classic.core import attend_packed, in_engine_step
from nnrun.attention.score_terms import HalfScores

_FAMILY = "_nnrun_attn_method_family"


@dataclass(frozen=True)
class AttnMethodFamily:
    """How one family's `_attn` scales and masks its scores."""

    scaling: Callable[[torch.nn.Module], float]  # multiplies q.k (HF divides by a norm factor, or not at all)
    sliding_window: Callable[[torch.nn.Module], int | None] = lambda module: None
    layer_index_attribute: str | None = "layer_idx"  # where HF keeps the layer's index (None: the registry numbers it)
    is_openai_gpt: bool = False  # keys come transposed, and the result is a list
    half_scores: HalfScores | None = None  # how `_attn` rounds its scores in half precision (None: as sdpa)


def install(family: AttnMethodFamily) -> Callable[[torch.nn.Module], None]:
    def adapt(module: torch.nn.Module) -> None:
        if getattr(module, "layer_idx", None) is None and family.layer_index_attribute is not None:
            module.layer_idx = getattr(module, family.layer_index_attribute)
        module.__dict__[_FAMILY] = family
        # A method bound to the module (not a closure): a deep copy of the model rebinds it to the copy.
        module._attn = types.MethodType(_attn, module)

    return adapt


def _attn(self: torch.nn.Module, query, key, value, attention_mask=None, *args, **kwargs):
    """HF's `_attn` outside a step; inside, the paged attention (the step's own masks, not HF's packed one)."""
    if not in_engine_step():
        return type(self)._attn(self, query, key, value, attention_mask, *args, **kwargs)
    family: AttnMethodFamily = self.__dict__[_FAMILY]
    if family.is_openai_gpt:
        key = key.transpose(-1, -2)  # [1, H, N, D] from HF's [1, H, D, N]
    out, probs = attend_packed(
        self,
        query,
        key,
        value,
        family.scaling(self),
        sliding_window=family.sliding_window(self),
        half_scores=family.half_scores,
    )  # [1, N, H, Dv]
    out = out.transpose(1, 2)  # [1, H, N, Dv], as HF's matmul of weights and values
    if family.is_openai_gpt:
        output_attentions = args[0] if args else kwargs.get("output_attentions", False)
        return [out, probs] if output_attentions or probs is not None else [out]
    return out, probs


def _gpt_neo_window(module: torch.nn.Module) -> int | None:
    # A local layer masks keys `window_size` or more positions back: HF's sliding window of that size.
    return module.config.window_size if module.attention_type == "local" else None


GPTJ = AttnMethodFamily(scaling=lambda module: 1.0 / module.scale_attn)
CODEGEN = AttnMethodFamily(scaling=lambda module: 1.0 / float(module.scale_attn))
GPT_NEO = AttnMethodFamily(  # GPT-Neo does not scale its scores
    scaling=lambda module: 1.0, sliding_window=_gpt_neo_window, layer_index_attribute="layer_id"
)
# One baddbmm scales q.k in the model's dtype, and the softmax's probabilities stay in it
GPT_NEOX_JAPANESE = AttnMethodFamily(
    scaling=lambda module: 1.0 / module.norm_factor, half_scores=HalfScores.BIAS_THEN_ROUND
)
OPENAI_GPT = AttnMethodFamily(
    scaling=lambda module: (module.split_size // module.n_head) ** -0.5 if module.scale else 1.0,
    layer_index_attribute=None,
    is_openai_gpt=True,
)
