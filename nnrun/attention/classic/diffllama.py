"""DiffLlama: differential attention, two interface calls per layer over the same queries and keys.

HF calls attention twice, with one query and key and two values built from the halves of `v_proj`'s
heads (`value1`, `value2`, each repeated back to every KV head), then concatenates the two outputs on
the last dim. The paged pool keeps one K/V per layer, which the second call would overwrite with its
own values. Since both calls share their softmax, one call over the values joined on the last dim
(`[value1 | value2]`, Dv = 2 * head_dim) gives each head that concatenation exactly, column by column
(in half precision the backend's kernel attends each half alone, as HF's two calls round):
inside a step the adapted forward makes that one call, and the rest is HF's code (rotary before,
the lambda combination and group norm after). Outside a step it is HF's own forward.
"""

from __future__ import annotations

import types

import torch

from nnrun.attention.classic.core import attend_packed, hf_file, in_engine_step


def adapt(module: torch.nn.Module) -> None:
    module.forward = types.MethodType(_forward, module)


def _forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
    if not in_engine_step():
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [1, Hq, N, D]
    key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [1, Hkv, N, D]
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [1, Hkv, N, D]
    cos, sin = position_embeddings
    query, key = hf_file(self).apply_rotary_pos_emb(query, key, cos, sin)
    value1, value2 = (half.repeat(1, 2, 1, 1) for half in torch.chunk(value, 2, dim=1))  # HF's, [1, Hkv, N, D] each
    joined = torch.cat([value1, value2], dim=-1)  # [1, Hkv, N, 2D]; two parts, as HF's two calls round
    out, probs = attend_packed(self, query, key, joined, self.scaling, num_value_parts=2)  # [1, N, Hq, 2D]
    # From here HF's code, on what its two calls' outputs concatenated would be.
    attn_output1, attn_output2 = torch.chunk(out, 2, dim=2)
    lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1, dtype=torch.float32)).to(query.dtype)
    lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1, dtype=torch.float32)).to(query.dtype)
    lambda_full = lambda_1 - lambda_2 + self.lambda_init
    attn_output = attn_output1 - lambda_full * attn_output2
    attn_output = (1 - self.lambda_init) * self.groupnorm(attn_output)
    return self.o_proj(attn_output.reshape(*input_shape, -1)), probs
