"""Pure-torch paged attention: the reference backend, and the one that runs anywhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nnrun.attention.base import AttentionBackend
from nnrun.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _ExtendRequest:
    q_start: int
    q_len: int
    prefix_len: int
    kv_slots: torch.Tensor  # [seq_len] int64 on the device


@dataclass
class _TorchMetadata:
    out_cache_loc: torch.Tensor  # [N]
    mode: ForwardMode
    extend_reqs: list[_ExtendRequest]
    decode_slots: torch.Tensor | None  # [B, max_seq_len] int64 (padding points at slot 0, then zeroed)
    decode_seq_lens: torch.Tensor | None  # [B] int64


class TorchAttnBackend(AttentionBackend):
    """Attention of each request's new tokens over its cached prefix and themselves.

    Extend steps loop over requests (each one causal, bottom-right aligned); decode steps gather
    every request's KV into one padded batch. Softmax runs in float32 when a softcap is present
    (as HF's eager path does); otherwise torch's SDPA kernel does the work.
    """

    name = "torch"

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        out_cache_loc = forward_batch.out_cache_loc.to(self.device)
        if forward_batch.forward_mode is ForwardMode.DECODE:
            seq_lens = forward_batch.seq_lens
            max_len = max(seq_lens)
            padded = torch.zeros((len(seq_lens), max_len), dtype=torch.int64)  # [B, max_seq_len]
            for row, slots in enumerate(forward_batch.kv_slots):
                padded[row, : slots.numel()] = slots
            self.metadata = _TorchMetadata(
                out_cache_loc, ForwardMode.DECODE, [], padded.to(self.device),
                torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            )
            return
        extend_reqs = [
            _ExtendRequest(start, q_len, prefix, slots.to(self.device))
            for start, q_len, prefix, slots in zip(
                forward_batch.extend_start_loc, forward_batch.extend_seq_lens,
                forward_batch.prefix_lens, forward_batch.kv_slots,
            )
        ]
        self.metadata = _TorchMetadata(out_cache_loc, ForwardMode.EXTEND, extend_reqs, None, None)

    def forward(self, layer_idx, q, k, v, scaling, sliding_window, softcap):
        meta = self.metadata
        self.kv_pool.write(layer_idx, meta.out_cache_loc, k, v)
        if meta.mode is ForwardMode.DECODE:
            return self._decode(layer_idx, q, scaling, sliding_window, softcap)
        k_flat, v_flat = self.kv_pool.k_flat(layer_idx), self.kv_pool.v_flat(layer_idx)
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))  # [N, Hq, Dv]
        for req in meta.extend_reqs:
            q_slice = slice(req.q_start, req.q_start + req.q_len)
            if req.prefix_len == 0:  # the whole KV is this step's: skip the gather
                req_k, req_v = k[q_slice], v[q_slice]
            else:
                req_k, req_v = k_flat[req.kv_slots], v_flat[req.kv_slots]
            out[q_slice] = _attend(q[q_slice], req_k, req_v, req.prefix_len, scaling, sliding_window, softcap)
        return out

    def _decode(self, layer_idx, q, scaling, sliding_window, softcap):
        meta = self.metadata
        batch_slots = meta.decode_slots.flatten()  # [B * L]
        k_flat, v_flat = self.kv_pool.k_flat(layer_idx), self.kv_pool.v_flat(layer_idx)
        keys = k_flat.index_select(0, batch_slots).view(*meta.decode_slots.shape, *k_flat.shape[1:])  # [B, L, Hkv, D]
        values = v_flat.index_select(0, batch_slots).view(*meta.decode_slots.shape, *v_flat.shape[1:])  # [B, L, Hkv, Dv]
        kv_pos = torch.arange(keys.shape[1], device=q.device)  # [L]
        q_pos = (meta.decode_seq_lens - 1)[:, None]  # [B, 1]
        allowed = kv_pos[None, :] <= q_pos  # [B, L]
        if sliding_window is not None:
            allowed &= kv_pos[None, :] > q_pos - sliding_window
        # Padding rows read whatever sits in slot 0 (another request's KV, or a freed page's), and a
        # masked score still multiplies its value: 0 * NaN is NaN. Selecting zeros instead makes
        # masked positions contribute exactly nothing, whatever the pool holds.
        keep = allowed[:, :, None, None]  # [B, L, 1, 1]
        keys = torch.where(keep, keys, keys.new_zeros(()))
        values = torch.where(keep, values, values.new_zeros(()))
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads = keys.shape[2]
        if softcap is None:
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=allowed[:, None, None, :], scale=scaling, enable_gqa=num_q_heads != num_kv_heads,
            )  # [B, Hq, 1, Dv]
            return out[:, :, 0]
        grouped_q = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
        scores = torch.einsum("bkgd,blkd->bkgl", grouped_q.float(), keys.float()) * scaling  # [B, Hkv, G, L]
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bkgl,blkd->bkgd", probs, values.float())  # [B, Hkv, G, Dv]
        return out.reshape(batch, num_q_heads, -1).to(q.dtype)


def _attend(q, k, v, prefix_len, scaling, sliding_window, softcap):
    """One request: q [n, Hq, D] at positions prefix_len.., k/v [L, Hkv, D] at positions 0..L-1."""
    q_len, kv_len = q.shape[0], k.shape[0]
    needs_mask = prefix_len > 0 or (sliding_window is not None and sliding_window < kv_len)
    allowed = None
    if needs_mask:
        q_pos = torch.arange(prefix_len, prefix_len + q_len, device=q.device)[:, None]  # [n, 1]
        kv_pos = torch.arange(kv_len, device=q.device)[None, :]  # [1, L]
        allowed = kv_pos <= q_pos  # [n, L]
        if sliding_window is not None:
            allowed &= kv_pos > q_pos - sliding_window
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=allowed, is_causal=allowed is None and q_len > 1, scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [1, Hq, n, Dv]
        return out[0].transpose(0, 1)
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    grouped_q = q.view(q_len, num_kv_heads, num_q_heads // num_kv_heads, q.shape[2])  # [n, Hkv, G, D]
    scores = torch.einsum("nkgd,lkd->kgnl", grouped_q.float(), k.float()) * scaling  # [Hkv, G, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    if allowed is None:
        allowed = torch.ones((q_len, kv_len), dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("kgnl,lkd->nkgd", scores.softmax(dim=-1), v.float())  # [n, Hkv, G, Dv]
    return out.reshape(q_len, num_q_heads, -1).to(q.dtype)
