"""Registers the engine's attention as a transformers attention implementation.

HF attention modules keep doing their own projections, norms, RoPE and output projection; only
the `attention_interface(...)` call they make lands here, so every module path, hook point and
output convention stays exactly HF's. Outside an engine step the same model object keeps working
as a plain HF model with sdpa attention, so users can still call it directly.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from nnrun.attention.context import current_backend, current_probs_plan
from nnrun.attention.probabilities import AttentionProbs

ATTN_IMPLEMENTATION = "nnrun_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, N, D]
    key: torch.Tensor,  # [1, Hkv, N, D]
    value: torch.Tensor,  # [1, Hkv, N, Dv]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, AttentionProbs | None]:
    backend = current_backend()
    if backend is None:  # the user calls the model directly (plain HF use): behave exactly as sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise RuntimeError(
            f"packed attention expects [1, H, N, D] with only this step's tokens, got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}"
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    q = query[0].transpose(0, 1)  # [N, Hq, D]
    sliding_window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    out = backend.forward(module.layer_idx, q, key[0].transpose(0, 1), value[0].transpose(0, 1),
                          scaling=scaling, sliding_window=sliding_window, softcap=softcap)  # [N, Hq, Dv]
    probs_plan = current_probs_plan()
    if probs_plan is None:  # nobody in the step asked: the second output is None, as sdpa's
        return out.unsqueeze(0), None  # [1, N, Hq, Dv]
    # After the backend: it has written this layer's K into the pool, and its output stays as it is.
    probs = probs_plan.compute(backend.kv_pool, module.layer_idx, q, scaling, sliding_window, softcap)
    return out.unsqueeze(0), probs


def paged_attention_mask(*args, **kwargs) -> torch.Tensor | None:
    """No mask inside an engine step (the backend knows each request's span); sdpa's mask outside."""
    if current_backend() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


@contextmanager
def hf_masks_skipped() -> Iterator[None]:
    """Within an engine step, HF prepares no attention mask at all.

    The mask builder above is registered so that the model, called plainly, masks like sdpa. But
    a registered name makes every mask factory (`create_causal_mask`, the sliding one) run its
    preprocessing first, `find_packed_sequence_indices` included (a `.all()` that syncs a GPU),
    before reaching a builder that returns None. HF's own early exit for implementations that
    build no mask skips all of it: while a step runs, the name is taken out of the mask registry.
    Re-entrant; the engine runs one step at a time (a plain call from another thread during a step
    already lands in the engine's attention, by the one forward context).
    """
    registry = AttentionMaskInterface._global_mapping
    builder = registry.pop(ATTN_IMPLEMENTATION, None)
    try:
        yield
    finally:
        if builder is not None:
            registry[ATTN_IMPLEMENTATION] = builder


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_attention_mask)
