"""What every classic adapter shares: is an engine step running, and one call into the paged attention."""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from nnrun.attention.context import current_backend
from nnrun.attention.hf_glue import paged_attention_forward
from nnrun.attention.probabilities import AttentionProbs


def in_engine_step() -> bool:
    """True while the engine runs a packed step (outside it, adapted modules run as HF's)."""
    return current_backend() is not None


def attend_packed(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, N, D]
    key: torch.Tensor,  # [1, Hkv, N, D]
    value: torch.Tensor,  # [1, Hkv, N, Dv]
    scaling: float,
    **features,
) -> tuple[torch.Tensor, AttentionProbs | None]:
    """The step's paged attention for this module: `[1, N, Hq, Dv]` in the values' dtype, and the probabilities slot.

    `features` are the glue's keywords (`sliding_window`, `alibi_slopes`). Query and key are cast to
    the values' dtype: some families rotate them in float32 (CodeGen), and HF's own cache stores keys
    in the model's dtype too.
    """
    dtype = value.dtype
    out, probs = paged_attention_forward(
        module, query.to(dtype), key.to(dtype), value, None, scaling=float(scaling), **features
    )
    return out, probs


def slopes_on(module: torch.nn.Module, key: str, device: torch.device) -> torch.Tensor:
    """The `[Hq]` float32 ALiBi slopes kept in `module.__dict__[key]`, moved to `device` once."""
    slopes = module.__dict__[key]
    if slopes.device != device:
        slopes = module.__dict__[key] = slopes.to(device)
    return slopes


def hf_file(module: torch.nn.Module) -> ModuleType:
    """The HF modeling file that defines the module's class (already imported: the model was built from it)."""
    return sys.modules[type(module).__module__]
