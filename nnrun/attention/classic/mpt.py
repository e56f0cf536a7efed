"""MPT: fused `Wqkv` (optionally clipped), ALiBi always, `out_proj` over the merged heads.

HF adds `slope * (key_position - last_key_position)` (MPT's own slopes, `alibi_bias_max=8` as
HF's model builds them) to the scaled scores; shift-invariant per query row, as in Bloom.
"""

from __future__ import annotations

import types

import torch

from nnrun.attention.classic.core import attend_packed, hf_file, in_engine_step, slopes_on
from nnrun.attention.score_terms import HalfScores

_SLOPES = "_nnrun_alibi_slopes"


def adapt(module: torch.nn.Module) -> None:
    alibi = hf_file(module).build_mpt_alibi_tensor(module.n_heads, 2)  # [H, 1, 2]: slope * [-1, 0]
    module.__dict__[_SLOPES] = -alibi[:, 0, 0].float()  # [H]
    module.forward = types.MethodType(_forward, module)


def _forward(self, hidden_states, position_bias, past_key_values=None, attention_mask=None, **kwargs):
    if not in_engine_step():
        return type(self).forward(self, hidden_states, position_bias, past_key_values, attention_mask, **kwargs)
    batch_size, seq_length = hidden_states.shape[:2]
    mixed_qkv = self.Wqkv(hidden_states)  # [1, N, 3 * hidden]
    if self.clip_qkv:
        mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (
        states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
        for states in mixed_qkv.chunk(3, dim=2)
    )  # 3 x [1, H, N, D]
    features = (
        {}
        if position_bias is None
        else {
            "alibi_slopes": slopes_on(self, _SLOPES, hidden_states.device),
            "half_scores": HalfScores.EAGER,
        }
    )
    out, probs = attend_packed(self, query, key, value, self.softmax_scale, **features)  # [1, N, H, D]
    context = out.reshape(batch_size, seq_length, -1)  # [1, N, hidden]
    return self.out_proj(context), probs
