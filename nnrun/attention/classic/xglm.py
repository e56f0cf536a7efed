"""XGLM: bart-style attention of its own (`q_proj` scaled before the product, `k_proj`, `v_proj`, `out_proj`).

HF scales the projected queries by `head_dim**-0.5` and multiplies them with the keys; the adapted
forward does the same and attends with a scale of 1, so the scores round as HF's do. Positions are
the sinusoidal table's (`embed_positions`, fed each request's own positions by nnrun/position_adapters).
Only self-attention runs in a step: a cross-attention call (given `key_value_states`) stays HF's.
"""

from __future__ import annotations

import types

import torch

from nnrun.attention.classic.core import attend_packed, in_engine_step


def adapt(module: torch.nn.Module) -> None:
    module.forward = types.MethodType(_forward, module)


def _forward(self, hidden_states, key_value_states=None, past_key_values=None, attention_mask=None, **kwargs):
    if not in_engine_step() or key_value_states is not None:
        return type(self).forward(self, hidden_states, key_value_states, past_key_values, attention_mask, **kwargs)
    batch_size, num_tokens, _ = hidden_states.shape
    head_shape = (batch_size, num_tokens, -1, self.head_dim)
    query = (self.q_proj(hidden_states) * self.scaling).view(head_shape).transpose(1, 2)  # [1, H, N, D]
    key = self.k_proj(hidden_states).view(head_shape).transpose(1, 2)  # [1, H, N, D]
    value = self.v_proj(hidden_states).view(head_shape).transpose(1, 2)  # [1, H, N, D]
    out, probs = attend_packed(self, query, key, value, 1.0)  # [1, N, H, D]; queries already scaled
    return self.out_proj(out.reshape(batch_size, num_tokens, self.embed_dim)), probs
