"""Falcon: fused `query_key_value` (multi-head, multi-query or grouped), rotary or ALiBi, then `dense`.

Rotary comes from the `position_embeddings` the model computed from the step's positions. With
ALiBi, HF's logits are `(q.k + slope * key_position) / sqrt(head_dim)`: slopes divided by
sqrt(head_dim), shift-invariant per query row as in Bloom.
"""

from __future__ import annotations

import types

import torch

from nnrun.attention.classic.core import attend_packed, hf_file, in_engine_step, slopes_on

_SLOPES = "_nnrun_alibi_slopes"


def adapt(module: torch.nn.Module) -> None:
    ones = torch.ones((1, 2))  # [1, 2] one unpadded request of two tokens
    alibi = hf_file(module).build_alibi_tensor(ones, module.num_heads, torch.float32)  # [H, 1, 2]: slope * [0, 1]
    module.__dict__[_SLOPES] = alibi[:, 0, 1] * module.inv_norm_factor  # [H] float32
    module.forward = types.MethodType(_forward, module)


def _forward(
    self,
    hidden_states,
    alibi,
    attention_mask,
    position_ids=None,
    layer_past=None,
    use_cache=False,
    output_attentions=False,
    position_embeddings=None,
    **kwargs,
):
    if not in_engine_step():
        return type(self).forward(
            self,
            hidden_states,
            alibi,
            attention_mask,
            position_ids,
            layer_past,
            use_cache,
            output_attentions,
            position_embeddings,
            **kwargs,
        )
    fused_qkv = self.query_key_value(hidden_states)  # [1, N, qkv_out_dim]
    num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    query, key, value = self._split_heads(fused_qkv)  # [1, N, H or Hkv, D] each
    batch_size, query_length, _, _ = query.shape
    query = query.transpose(1, 2).reshape(batch_size, self.num_heads, query_length, self.head_dim)
    key = key.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, self.head_dim)
    value = value.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, self.head_dim)
    if self.new_decoder_architecture:
        # HF broadcast each KV head over its query group; the paged cache keeps one copy per group.
        group = self.num_heads // self.num_kv_heads
        key, value = key[:, ::group], value[:, ::group]  # [1, Hkv, N, D]
    features = {}
    if alibi is None:
        cos, sin = position_embeddings
        query, key = hf_file(self).apply_rotary_pos_emb(query, key, cos, sin)
    else:
        features["alibi_slopes"] = slopes_on(self, _SLOPES, hidden_states.device)  # [H]
    out, probs = attend_packed(self, query, key, value, self.inv_norm_factor, **features)  # [1, N, H, D]
    attn_output = out.reshape(batch_size, query_length, self.num_heads * self.head_dim)
    return self.dense(attn_output), probs
