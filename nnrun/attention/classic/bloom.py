"""Bloom: fused `query_key_value`, ALiBi, `dense` over the merged heads (its own forward, core inline).

HF's scores are `beta * alibi + inv_norm_factor * q.k` with `alibi = slope * key_position` (no
padding in a packed request); softmax is shift-invariant per query row, so the paged attention's
`slope * (key_pos - query_pos)` gives the same probabilities.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from nnrun.attention.classic.core import attend_packed, hf_file, in_engine_step, slopes_on
from nnrun.attention.score_terms import HalfScores

_SLOPES = "_nnrun_alibi_slopes"


def adapt(module: torch.nn.Module) -> None:
    ones = torch.ones((1, 2))  # [1, 2] one unpadded request of two tokens
    alibi = hf_file(module).build_alibi_tensor(ones, module.num_heads, torch.float32)  # [H, 1, 2]: slope * [0, 1]
    module.__dict__[_SLOPES] = alibi[:, 0, 1].clone()  # [H] HF's own slopes, float32
    module.forward = types.MethodType(_forward, module)


def _forward(
    self,
    hidden_states,
    residual,
    alibi,
    attention_mask,
    layer_past=None,
    use_cache=False,
    output_attentions=False,
    **kwargs,
):
    if not in_engine_step():
        return type(self).forward(
            self, hidden_states, residual, alibi, attention_mask, layer_past, use_cache, output_attentions, **kwargs
        )
    batch_size, q_length, _ = hidden_states.shape
    fused_qkv = self.query_key_value(hidden_states)  # [1, N, 3 * hidden]
    query, key, value = self._reshape(fused_qkv)  # 3 x [1, H, N, D]
    slopes = slopes_on(self, _SLOPES, hidden_states.device) * self.beta  # [H]
    out, probs = attend_packed(
        self, query, key, value, self.inv_norm_factor, alibi_slopes=slopes, half_scores=HalfScores.BIAS_THEN_ROUND
    )  # [1, N, H, D]
    context = out.reshape(batch_size, q_length, self.num_heads * self.head_dim)  # what HF's `_merge_heads` gives
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            output = output + F.linear(
                context[:, :, int(i * slices) : int((i + 1) * slices)],
                self.dense.weight[:, int(i * slices) : int((i + 1) * slices)],
            )
    else:
        output = self.dense(context)
    output = hf_file(self).dropout_add(output, residual, self.hidden_dropout, self.training)
    return output, probs
