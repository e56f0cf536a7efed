"""Inkling and Inkling 2: HF's attention code, with a relative position bias (a logit per query and key distance).

HF passes the bias to the attention interface densely, `[B, H, q_len, kv_len]`, gathered at positions
it numbers itself (`arange` of the call, plus its cache's offset): in a packed step those run over the
whole batch's tokens, and the cached keys are missing. So inside a step the layer's `rel_logits_proj`
returns HF's own product before that gather, each query's logits per distance `[1, H, N, E]`; the
module passes them on as `position_bias`, and the glue hands them to the backend as `relative_logits`,
which adds each at its request's own distances. Inkling 2 also passes one sink logit per query and head
(`sinks`, `[1, H, N, 1]`): per token already, the glue hands them on as they are.

Inkling's full layers with `log_scaling_n_floor` set also scale queries and that bias by a function of
the positions HF numbered: the glue rescales both to each query's own position (`QUERY_RESCALE`).
Inkling 2 scales them by the `position_ids` it is given, which are each request's own already.
Outside a step everything is HF's.
"""

from __future__ import annotations

import types

import torch

from nnrun.attention.classic.core import in_engine_step
from nnrun.attention.hf_glue import PER_QUERY_SCORE_TERMS, QUERY_RESCALE


def adapt_inkling(module: torch.nn.Module) -> None:
    adapt_inkling2(module)
    if not module.is_sliding and module.config.log_scaling_n_floor is not None:
        module.__dict__[QUERY_RESCALE] = _log_scaling_rescale


def adapt_inkling2(module: torch.nn.Module) -> None:
    module.__dict__[PER_QUERY_SCORE_TERMS] = True
    relative = module.rel_logits_proj
    relative.forward = types.MethodType(_relative_logits, relative)


def _relative_logits(self, relative_states, query_positions, key_positions):
    """HF's dense bias outside a step; inside, `[1, H, N, E]`: each query's logit per backward distance."""
    if not in_engine_step():
        return type(self).forward(self, relative_states, query_positions, key_positions)
    return (relative_states @ self.proj).transpose(1, 2)  # [1, N, H, E] -> [1, H, N, E], as HF's before its gather


def _log_scale(module: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """HF Inkling's `tau` at `positions` (`[N]`), float32."""
    config = module.config
    return 1.0 + config.log_scaling_alpha * torch.log(
        ((positions + 1).float() / config.log_scaling_n_floor).clamp(min=1.0)
    )


def _log_scaling_rescale(module: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """`[N]` factors taking each query (and its relative logits) from HF's packed numbering `0..N-1` to its own position."""
    positions = position_ids[0]  # [N]
    packed = torch.arange(positions.shape[0], device=positions.device)  # [N] what HF numbered them
    return _log_scale(module, positions) / _log_scale(module, packed)
