"""Pure-torch paged attention: the reference backend, and the one that runs anywhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from nnrun.attention.base import AttentionBackend, DecodeOps
from nnrun.attention.masks import alibi_bias, allowed_keys, relative_position_bias, selected_keys
from nnrun.attention.score_terms import HalfScores, ScoreTerms
from nnrun.attention.step_layout import ExtendGroup, extend_groups, padded_decode_slots, rows_fill_table
from nnrun.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _TorchMetadata:
    out_cache_loc: torch.Tensor  # [N]
    mode: ForwardMode
    extend_groups: list[ExtendGroup]
    decode_slots: torch.Tensor | None  # [B, max_seq_len] int64 (padding points at the pool's zero page)
    decode_flat_slots: torch.Tensor | None = None  # [B * max_seq_len] int64, `decode_slots` flattened once per step
    # Every decode row's KV fills all max_seq_len columns (equal lengths): no key lies past a row's end
    decode_rows_full: bool = False
    # Decode masks by (sliding window, chunk size) (None, None: full causal), built by the first layer
    # that asks: every layer of that kind reads the same one.
    decode_masks: dict[tuple, torch.Tensor] = field(default_factory=dict)  # each [B, 1, 1, max_seq_len] bool
    # The same as additive masks over heads packed as keys, by (window, chunk, Hq, Hkv): see `_attend_heads_as_keys`
    heads_as_keys_masks: dict[tuple, torch.Tensor] = field(default_factory=dict)  # each [B or 1, Hq, L * Hkv]
    decode_batch: ForwardBatch | None = None  # the decode step, whose KV lengths a layer that needs them reads
    # A decode graph's step (nnrun/traced_graph.py) is padded to its graph's size: the rows past these are padding
    rows: int | None = None
    _decode_seq_lens: torch.Tensor | None = None

    @property
    def decode_seq_lens(self) -> torch.Tensor:
        """[B] int64 each decode row's KV length, made when a layer first needs it (equal full rows never do)."""
        if self._decode_seq_lens is None:
            seq_lens = torch.from_numpy(np.array(self.decode_batch.seq_lens, dtype=np.int64))
            self._decode_seq_lens = seq_lens.to(self.decode_slots.device)
        return self._decode_seq_lens


class TorchAttnBackend(AttentionBackend):
    """Attention of each request's new tokens over its cached prefix and themselves.

    Extend steps batch requests of equal (prefix, length) shape into one call each (causal,
    bottom-right aligned), as HF's padded batch would for equal prompts; decode steps gather every
    request's KV into one padded batch, its masks planned once per step for all layers. On CPU, a
    decode layer with small heads and plain scores (`_has_plain_scores`) attends with heads packed
    as keys, two batched matmuls in float32 (`_attend_heads_as_keys`). Elsewhere softmax runs in
    float32 when a softcap or attention sinks or ALiBi slopes are present (as HF's eager path
    does); otherwise torch's SDPA kernel does the work. Sliding windows, attention chunks, ALiBi
    biases and relative logits (Inkling's per-query logits by distance) apply per request, at its
    own positions, and so do DSA sparse attention's picks (`key_indices`): a query sees only the
    causal keys its indexer picked.
    """

    name = "torch"

    def __init__(self, kv_pool, device: torch.device) -> None:
        super().__init__(kv_pool, device)
        # Additive heads-as-keys masks with every key position allowed, by (Hq, Hkv), kept across steps and
        # grown as contexts grow: a step whose rows all see all their keys slices its mask from one of these.
        self._open_masks: dict[tuple[int, int], torch.Tensor] = {}  # each [Hq, capacity * Hkv] float32

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        out_cache_loc = forward_batch.out_cache_loc.to(self.device)
        if forward_batch.forward_mode is ForwardMode.DECODE:
            table = forward_batch.kv_slot_table
            rows_full = table is not None and rows_fill_table(forward_batch, table.shape[1])
            seq_lens = None  # [B], made here only to pad shorter rows (else by the first layer that needs it)
            if rows_full:  # equal lengths: the request table's rows are the slots, nothing to pad
                padded = table.to(self.device)  # [B, L]
            else:
                # through numpy, which reads a list of ints several times faster than torch.tensor
                seq_lens = torch.from_numpy(np.array(forward_batch.seq_lens, dtype=np.int64))
                padded = padded_decode_slots(forward_batch, seq_lens, self.kv_pool.zero_slot).to(self.device)
                seq_lens = seq_lens.to(self.device)
            self.metadata = _TorchMetadata(
                out_cache_loc,
                ForwardMode.DECODE,
                [],
                padded,
                padded.flatten(),
                decode_rows_full=rows_full or rows_fill_table(forward_batch, padded.shape[1]),
                decode_batch=forward_batch,
                _decode_seq_lens=seq_lens,
            )
            return
        groups = extend_groups(forward_batch, self.device)
        self.metadata = _TorchMetadata(out_cache_loc, ForwardMode.EXTEND, groups, None)

    # ---- decode graphs on CPU --------------------------------------------------------------
    # `traced_graph.TracedCapturer` replays a decode step's ops around this backend's calls, which run
    # eagerly on each step's own plan: a graph's step is this plan padded to the graph's size.

    @property
    def plans_graph_steps(self) -> bool:
        return True

    def init_cuda_graph_state(self, batch_sizes: Sequence[int]) -> None:
        """Nothing kept across steps: each step's plan is its own (the attention calls run eagerly)."""

    def init_forward_metadata_capture(self, batch_size: int, out_cache_loc: torch.Tensor) -> None:
        zero_slots = torch.full((batch_size, 1), self.kv_pool.zero_slot, dtype=torch.int64, device=self.device)
        ones = torch.ones(batch_size, dtype=torch.int64, device=self.device)
        self.metadata = _TorchMetadata(
            out_cache_loc, ForwardMode.DECODE, [], zero_slots, zero_slots.flatten(), True, _decode_seq_lens=ones
        )

    def init_forward_metadata_replay(
        self, batch_size: int, forward_batch: ForwardBatch, out_cache_loc: torch.Tensor
    ) -> None:
        self.init_forward_metadata(forward_batch)
        self.metadata.out_cache_loc = out_cache_loc  # [batch_size]: padding rows write the trash slot
        self.metadata.rows = forward_batch.batch_size

    def forward(self, layer_idx, q, k, v, terms: ScoreTerms):
        meta = self.metadata
        self.kv_pool.write(layer_idx, meta.out_cache_loc, k, v)
        if meta.mode is ForwardMode.DECODE:
            rows = meta.rows
            if rows is not None and rows < q.shape[0]:  # a graph's padded step: padding rows attend to nothing
                out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))  # [B padded, Hq, Dv]
                out[:rows] = self._decode(layer_idx, q[:rows], terms.of_queries(lambda term: term[:rows]))
                return out
            return self._decode(layer_idx, q, terms)
        groups = meta.extend_groups
        if len(groups) == 1 and groups[0].covers(q.shape[0]):  # one shape, in order: its output is the step's
            return self._extend_group(layer_idx, groups[0], q, k, v, terms).flatten(0, 1)  # [N, Hq, Dv]
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))  # [N, Hq, Dv]
        for group in groups:
            attended = self._extend_group(layer_idx, group, q, k, v, terms)  # [G, n, Hq, Dv]
            attended = attended.reshape(group.size * group.q_len, *attended.shape[2:])
            if group.token_indices is None:
                out[group.token_span] = attended
            else:
                out.index_copy_(0, group.token_indices, attended)
        return out

    def _extend_group(self, layer_idx: int, group: ExtendGroup, q, k, v, terms: ScoreTerms) -> torch.Tensor:
        """One group's new tokens over their KV -> `[G, n, Hq, Dv]`; the group's per-query terms as `[G, n, ...]`."""
        group_q, new_k, new_v = group.rows(q), group.rows(k), group.rows(v)  # [G, n, H, D]
        if group.kv_slots is None:  # the whole KV is this step's: skip the pool
            keys, values = new_k, new_v
        else:
            k_flat, v_flat = self.kv_pool.k_flat(layer_idx), self.kv_pool.v_flat(layer_idx)
            slots = group.kv_slots.flatten()
            keys = k_flat.index_select(0, slots).view(*group.kv_slots.shape, *k_flat.shape[1:])  # [G, L, Hkv, D]
            values = v_flat.index_select(0, slots).view(*group.kv_slots.shape, *v_flat.shape[1:])
        return _attend(group_q, keys, values, group.prefix_len, terms.of_queries(group.rows))

    def _decode(self, layer_idx, q, terms: ScoreTerms):
        """Each request's one new token over its KV: the step's padded slots, gathered once per layer."""
        meta = self.metadata
        k_flat, v_flat = self.kv_pool.k_flat(layer_idx), self.kv_pool.v_flat(layer_idx)
        shape = meta.decode_slots.shape  # (B, L)
        keys = k_flat.index_select(0, meta.decode_flat_slots).view(*shape, *k_flat.shape[1:])  # [B, L, Hkv, D]
        values = v_flat.index_select(0, meta.decode_flat_slots).view(*shape, *v_flat.shape[1:])  # [B, L, Hkv, Dv]
        if _has_plain_scores(terms) and _heads_fit_as_keys(q, keys):
            mask = self._step_heads_as_keys_mask(terms, q.shape[1], keys.shape[2])  # [B or 1, Hq, L * Hkv]
            return _attend_heads_as_keys(q, keys, values, mask, terms.scaling, terms.softcap)
        allowed = self._decode_mask(terms.sliding_window, terms.chunk_size, keys.shape[1])  # [B, 1, 1, L]
        return self._decode_any_terms(q, keys, values, allowed, terms)

    def decode_ops(self, layer_idx, q, k, v, terms: ScoreTerms) -> DecodeOps | None:
        """A decode layer of plain scores as ops: the KV write, the gather of the step's slots and the attention
        `_decode` would run (heads as keys, or SDPA), the views written with -1 where the KV length goes. Other
        terms (HF eager's arithmetic) stay the backend's own calls, and so does a padded graph's step."""
        k_flat, v_flat = self.kv_pool.k_flat(layer_idx), self.kv_pool.v_flat(layer_idx)
        if (
            q.dim() != 3
            or not _has_plain_scores(terms)
            or (k.dtype, v.dtype) != (k_flat.dtype, v_flat.dtype)
            or k.requires_grad
            or v.requires_grad
        ):
            return None
        heads_as_keys = _heads_fit_as_keys(q, k_flat[None])  # (its KV heads on dim 2, as `_decode`'s gathered keys)
        if not heads_as_keys and (terms.softcap is not None or terms.rounds_as_hf_eager(q.dtype)):
            return None
        num_rows, num_q_heads, num_kv_heads = q.shape[0], q.shape[1], k_flat.shape[1]
        head_dim, value_dim = k_flat.shape[-1], v_flat.shape[-1]

        def run(q, k, v, out_cache_loc, flat_slots, mask, k_flat, v_flat) -> torch.Tensor:
            k_flat.index_copy_(0, out_cache_loc, k)  # as `KVPool.write`
            v_flat.index_copy_(0, out_cache_loc, v)
            if heads_as_keys:
                flat_keys = k_flat.index_select(0, flat_slots).view(num_rows, -1, head_dim)  # [B, L * Hkv, D]
                flat_values = v_flat.index_select(0, flat_slots).view(num_rows, -1, value_dim)
                return _attend_flat_heads_as_keys(q, flat_keys, flat_values, mask, terms.scaling, terms.softcap)
            keys = k_flat.index_select(0, flat_slots).view(num_rows, -1, num_kv_heads, head_dim)  # [B, L, Hkv, D]
            values = v_flat.index_select(0, flat_slots).view(num_rows, -1, num_kv_heads, value_dim)
            return _sdpa_decode(q, keys, values, terms, mask, gqa=num_q_heads != num_kv_heads)

        def inputs() -> list[torch.Tensor]:
            meta = self.metadata
            if heads_as_keys:
                mask = self._step_heads_as_keys_mask(terms, num_q_heads, num_kv_heads)  # [B or 1, Hq, L * Hkv]
            else:
                mask = self._decode_mask(terms.sliding_window, terms.chunk_size, meta.decode_slots.shape[1])
            pool = self.kv_pool  # (read at each replay, as the eager call reads it)
            return [meta.out_cache_loc, meta.decode_flat_slots, mask, pool.k_flat(layer_idx), pool.v_flat(layer_idx)]

        def fits() -> bool:
            meta = self.metadata
            return meta.mode is ForwardMode.DECODE and meta.rows in (None, num_rows)

        return DecodeOps(run, inputs, fits)

    def _decode_any_terms(self, q, keys, values, allowed, terms: ScoreTerms):
        """SDPA for plain scores, else HF eager's float32 arithmetic with every term of `terms`."""
        softcap, sinks, alibi_slopes = terms.softcap, terms.sinks, terms.alibi_slopes
        key_indices, relative_logits = terms.key_indices, terms.relative_logits
        meta = self.metadata
        if key_indices is not None:  # [B, K] each query's picks (DSA sparse attention)
            allowed = allowed & selected_keys(key_indices, keys.shape[1])[:, None, None, :]  # [B, 1, 1, L]
        plain = softcap is None and sinks is None and alibi_slopes is None and relative_logits is None
        if plain and not terms.rounds_as_hf_eager(q.dtype):
            return _sdpa_decode(q, keys, values, terms, allowed)
        bias = None
        kv_pos = torch.arange(keys.shape[1], device=q.device)  # [L]
        distance = kv_pos[None, :] - (meta.decode_seq_lens - 1)[:, None]  # [B, L] key_pos - query_pos
        if alibi_slopes is not None:
            from_keys = _alibi_distance(terms, q.dtype, distance, kv_pos[None, :])  # [B or 1, L]
            bias = alibi_bias(alibi_slopes, keys.shape[2], from_keys[:, None, None, None, :])  # [B, Hkv, R, 1, L]
        if relative_logits is not None:  # [B, Hq, E]: each request's one query
            relative = relative_position_bias(relative_logits[:, :, None], keys.shape[2], -distance[:, None, None])
            bias = relative if bias is None else bias + relative  # [B, Hkv, R, 1, L]
        if sinks is not None and sinks.dim() == 2:  # [B, Hq] one sink logit per request's query
            sinks = sinks[:, None]  # [B, 1, Hq]
        if terms.half_eager is not None and q.dtype != torch.float32:
            return _run_hf_eager(terms, q[:, None], keys, values, allowed, bias, sinks)[:, 0]  # [B, Hq, Dv]
        out = _eager_attend(
            q[:, None], keys, values, allowed[:, None], terms.scaling, softcap, sinks, bias, terms.half_scores
        )
        return out[:, 0]  # [B, 1, Hq, Dv] -> [B, Hq, Dv]

    def _step_heads_as_keys_mask(self, terms: ScoreTerms, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
        """`_heads_as_keys_mask` of the step's allowed keys, built by the first layer of its kind that asks.

        When every row sees every one of its L keys (equal lengths, no window or chunk that binds), the
        mask is the same for every row: `[1, Hq, L * Hkv]`, a slice of a mask kept across steps, equal
        value for value to the one built from the step's all-true `allowed` (and broadcast by the matmul).
        """
        masks = self.metadata.heads_as_keys_masks
        key = (terms.sliding_window, terms.chunk_size, num_q_heads, num_kv_heads)
        mask = masks.get(key)
        if mask is None:
            kv_len = self.metadata.decode_slots.shape[1]
            if self.metadata.decode_rows_full and _limits_open(terms.sliding_window, terms.chunk_size, kv_len):
                mask = self._open_heads_as_keys_mask(num_q_heads, num_kv_heads, kv_len)
            else:
                allowed = self._decode_mask(terms.sliding_window, terms.chunk_size, kv_len)  # [B, 1, 1, L]
                mask = _heads_as_keys_mask(allowed, num_q_heads, num_kv_heads)
            masks[key] = mask
        return mask

    def _open_heads_as_keys_mask(self, num_q_heads: int, num_kv_heads: int, kv_len: int) -> torch.Tensor:
        """[1, Hq, kv_len * Hkv]: the heads-as-keys mask of a row that sees all of its kv_len keys."""
        kept = self._open_masks.get((num_q_heads, num_kv_heads))
        if kept is None or kept.shape[1] < kv_len * num_kv_heads:
            capacity = max(2 * kv_len, 256)  # grown by doubling: rebuilt a few times per context, not per step
            all_keys = torch.ones((1, 1, 1, capacity), dtype=torch.bool, device=self.device)
            kept = self._open_masks[num_q_heads, num_kv_heads] = _heads_as_keys_mask(
                all_keys, num_q_heads, num_kv_heads
            )[0]
        return kept[None, :, : kv_len * num_kv_heads]  # a view: position l, KV head g at column l * Hkv + g

    def _decode_mask(self, sliding_window: int | None, chunk_size: int | None, kv_len: int) -> torch.Tensor:
        """[B, 1, 1, kv_len] bool: which KV positions each request's one new token sees; built once per step."""
        masks = self.metadata.decode_masks
        allowed = masks.get((sliding_window, chunk_size))
        if allowed is None:
            seq_lens = self.metadata.decode_seq_lens  # [B]
            kv_pos = torch.arange(kv_len, device=seq_lens.device)[None, :]  # [1, L]
            q_pos = (seq_lens - 1)[:, None]  # [B, 1]
            allowed = allowed_keys(q_pos, kv_pos, sliding_window, chunk_size)[:, None, None, :]
            masks[sliding_window, chunk_size] = allowed
        return allowed


def _limits_open(sliding_window: int | None, chunk_size: int | None, kv_len: int) -> bool:
    """Whether a query at position kv_len - 1 sees every key 0..kv_len - 1 under this window and chunk."""
    return (sliding_window is None or sliding_window >= kv_len) and (chunk_size is None or kv_len <= chunk_size)


def _has_plain_scores(terms: ScoreTerms) -> bool:
    """Scores are scaled q.k, maybe softcapped, under the step's mask: nothing per head or per query joins them."""
    return (
        terms.sinks is None
        and terms.alibi_slopes is None
        and terms.key_indices is None
        and terms.relative_logits is None
    )


def _heads_fit_as_keys(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether packing heads as keys (`_attend_heads_as_keys`) beats SDPA for this layer's decode.

    It does on CPU for small heads, where SDPA's kernel pays a fixed cost per (request, head) that
    outweighs the math (measured: 1.5-2.5x at head_dim 16, 2-8 KV heads); its waste of Hkv - 1 of
    every Hkv multiply-adds makes it lose at head_dim 64 or on an accelerator's fused kernels.
    In half precision SDPA stays: its rounding is HF's (sdpa's), which float32 matmuls rounded once are not.
    """
    return q.device.type == "cpu" and q.dtype == torch.float32 and keys.shape[-1] <= 32 and keys.shape[2] <= 8


def _heads_as_keys_mask(allowed: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, L * Hkv] float32, 0 or -inf: query head h sees key (l, kv head g) when l is allowed and g is h's."""
    num, kv_len = allowed.shape[0], allowed.shape[-1]
    group = num_q_heads // num_kv_heads
    by_position = torch.zeros((num, kv_len), device=allowed.device).masked_fill_(
        ~allowed.view(num, kv_len), float("-inf")
    )  # [B, L]
    mask = torch.full((num, num_kv_heads, group, kv_len, num_kv_heads), float("-inf"), device=allowed.device)
    # [B, R, L, Hkv] view of the entries where query head (g, r) meets KV head g: each gets its position's mask
    torch.diagonal(mask, dim1=1, dim2=4).copy_(by_position[:, None, :, None].expand(num, group, kv_len, num_kv_heads))
    return mask.view(num, num_q_heads, kv_len * num_kv_heads)


def _attend_heads_as_keys(q, keys, values, mask, scaling: float, softcap: float | None) -> torch.Tensor:
    """Decode attention as two batched matmuls per step's layer, heads packed as keys, in float32.

    q [B, Hq, D]; keys/values [B, L, Hkv, D] as gathered, read as [B, L * Hkv, D] (a view, no GQA copy);
    `mask` [B, Hq, L * Hkv] from `_heads_as_keys_mask`. Each request's query heads meet all of its
    L * Hkv keys at once, and the mask drops the other heads' keys (exp(-inf) = 0 exactly), so each
    head's softmax and sum run over its own keys only: HF eager's arithmetic in float32, as
    `_eager_attend` does, with one matmul per request instead of SDPA's one per (request, head).
    """
    num, kv_len, num_kv_heads, head_dim = keys.shape
    flat_keys = keys.reshape(num, kv_len * num_kv_heads, head_dim)  # [B, L * Hkv, D]
    flat_values = values.reshape(num, kv_len * num_kv_heads, values.shape[-1])  # [B, L * Hkv, Dv]
    return _attend_flat_heads_as_keys(q, flat_keys, flat_values, mask, scaling, softcap)


def _attend_flat_heads_as_keys(q, flat_keys, flat_values, mask, scaling: float, softcap: float | None) -> torch.Tensor:
    """`_attend_heads_as_keys` on keys and values already read as `[B, L * Hkv, D]`."""
    flat_keys, flat_values = flat_keys.float(), flat_values.float()
    if softcap is None:
        scores = torch.baddbmm(mask, q.float(), flat_keys.transpose(1, 2), alpha=scaling)  # [B, Hq, L * Hkv]
    else:
        scores = torch.bmm(q.float(), flat_keys.transpose(1, 2)) * scaling
        scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.bmm(scores.softmax(dim=-1), flat_values).to(q.dtype)  # [B, Hq, Dv]


def _attend(q, k, v, prefix_len, terms: ScoreTerms):
    """G requests of one shape: q [G, n, Hq, D] at positions prefix_len.., k/v [G, L, Hkv, D] at 0..L-1.

    `terms`' per-query ones are the group's, `[G, n, ...]`: `key_indices` ([G, n, K] key positions, -1
    for none) restricts each query to the keys its indexer picked; `relative_logits` ([G, n, Hq, E]) are
    each query's logits by backward distance.
    """
    scaling, sliding_window, softcap, sinks = terms.scaling, terms.sliding_window, terms.softcap, terms.sinks
    chunk_size, alibi_slopes, picks, relative = (
        terms.chunk_size,
        terms.alibi_slopes,
        terms.key_indices,
        terms.relative_logits,
    )
    q_len, kv_len = q.shape[1], k.shape[1]
    limits_bind = any(limit is not None and limit < kv_len for limit in (sliding_window, chunk_size))
    allowed = bias = None
    if prefix_len > 0 or limits_bind or alibi_slopes is not None or picks is not None or relative is not None:
        q_pos = torch.arange(prefix_len, prefix_len + q_len, device=q.device)[:, None]  # [n, 1]
        kv_pos = torch.arange(kv_len, device=q.device)[None, :]  # [1, L]
        allowed = allowed_keys(q_pos, kv_pos, sliding_window, chunk_size)  # [n, L]
        if alibi_slopes is not None:
            from_keys = _alibi_distance(terms, q.dtype, kv_pos - q_pos, kv_pos)  # [n or 1, L]
            bias = alibi_bias(alibi_slopes, k.shape[2], from_keys)  # [Hkv, R, n or 1, L]
        if relative is not None:
            by_distance = relative_position_bias(relative.transpose(1, 2), k.shape[2], q_pos - kv_pos)
            bias = by_distance if bias is None else bias + by_distance  # [G, Hkv, R, n, L]
        if picks is not None:  # per request and query: [G, 1, n, L], heads broadcast
            allowed = (allowed & selected_keys(picks, kv_len))[:, None]
    if softcap is None and sinks is None and bias is None and not terms.rounds_as_hf_eager(q.dtype):
        out = _sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), terms, allowed, allowed is None and q_len > 1
        )  # [G, Hq, n, Dv]
        return out.transpose(1, 2)
    if allowed is None:
        allowed = torch.ones((q_len, kv_len), dtype=torch.bool, device=q.device).tril()
    if terms.half_eager is not None and q.dtype != torch.float32:
        return _run_hf_eager(terms, q, k, v, allowed, bias, sinks)
    if picks is not None:
        allowed = allowed[:, :, None]  # [G, 1, 1, n, L] against eager's [G, Hkv, R, n, L]
    return _eager_attend(q, k, v, allowed, scaling, softcap, sinks, bias, terms.half_scores)


def _sdpa(q, k, v, terms: ScoreTerms, attn_mask=None, is_causal: bool = False, gqa: bool | None = None) -> torch.Tensor:
    """torch's SDPA on q [G, Hq, n, D], k/v [G, Hkv, L, D(v)]: `[G, Hq, n, Dv]`.

    Values of `terms.num_value_parts` parts attend one call per part in half precision, as HF's calls do:
    the kernel's rounding depends on the values' width. In float32 one call gives the same numbers.
    `gqa` (Hq != Hkv) given by a caller whose shapes are traced values (`decode_ops`), else read off them.
    """
    kwargs = {
        "attn_mask": attn_mask,
        "is_causal": is_causal,
        "scale": terms.scaling,
        "enable_gqa": q.shape[1] != k.shape[1] if gqa is None else gqa,
    }
    if terms.num_value_parts == 1 or q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    parts = v.chunk(terms.num_value_parts, dim=-1)
    return torch.cat([F.scaled_dot_product_attention(q, k, part, **kwargs) for part in parts], dim=-1)


def _sdpa_decode(q, keys, values, terms: ScoreTerms, allowed, gqa: bool | None = None) -> torch.Tensor:
    """`_sdpa` of each request's one query, q [B, Hq, D], over its keys/values [B, L, Hkv, D(v)] -> `[B, Hq, Dv]`."""
    out = _sdpa(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), terms, attn_mask=allowed, gqa=gqa)
    return out[:, :, 0]  # [B, Hq, 1, Dv] -> [B, Hq, Dv]


def _run_hf_eager(terms: ScoreTerms, q, k, v, allowed, bias, sinks) -> torch.Tensor:
    """The layer's own HF eager attention (`terms.half_eager`): q [G, n, Hq, D], k/v [G, L, Hkv, D] -> [G, n, Hq, Dv].

    `allowed` (bool, broadcast to `[G, Hq, n, L]`) becomes HF's additive eager mask: 0, or the dtype's minimum.
    Relative logits' `bias` (float32 `[G, Hkv, R, n, L]`) and per-query `sinks` (`[G, n, Hq]`) go in as HF's
    module passes them; per-head sinks the eager code reads from its module.
    """
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, torch.finfo(q.dtype).min)
    extra = {}
    if bias is not None:
        extra["position_bias"] = bias.flatten(-4, -3).to(q.dtype)  # [G, Hq, n, L], HF's values in the dtype
    if sinks is not None and sinks.dim() > 1:  # one per query (per-head ones, [Hq], are the module's)
        extra["sinks"] = sinks.transpose(1, 2)[..., None]  # [G, Hq, n, 1]
    out, _ = terms.half_eager(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scaling=terms.scaling, dropout=0.0, **extra
    )
    return out  # [G, n, Hq, Dv]


def _alibi_distance(
    terms: ScoreTerms, dtype: torch.dtype, distance: torch.Tensor, kv_pos: torch.Tensor
) -> torch.Tensor:
    """Float32 positions ALiBi's slopes multiply: `key_pos - query_pos` (`distance`), shift-invariant per query row.

    Bloom's HF bias is `slope * key_pos` rounded to the model's dtype, whose rounding depends on `key_pos`
    itself: in half precision its bias is built at `kv_pos` (`[1, L]`) so that `_eager_attend` rounds as HF.
    """
    if terms.half_scores is HalfScores.BIAS_THEN_ROUND and dtype != torch.float32:
        return kv_pos.float()
    return distance.float()


def _half_scores(qk, scaling, softcap, bias, half_scores: HalfScores | None, dtype: torch.dtype) -> torch.Tensor:
    """Float32 scores: `qk * scaling`, ALiBi's `bias`, the softcap; rounded to `dtype` where HF's half-precision code does."""
    if half_scores is None or dtype == torch.float32:
        scores = qk * scaling
        if bias is not None:
            scores = scores + bias
        return scores if softcap is None else torch.tanh(scores / softcap) * softcap
    if half_scores is HalfScores.BIAS_THEN_ROUND:  # one baddbmm of any rounded bias and the scaled q.k
        scores = qk * scaling if bias is None else bias.to(dtype).float() + qk * scaling
        return scores.to(dtype).float()
    scores = qk.to(dtype) * scaling  # HF eager: matmul, scaling and softcap each in the dtype
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores.float() if bias is None else scores.float() + bias  # MPT's bias joins in float32


def _eager_attend(q, k, v, allowed, scaling, softcap, sinks, bias=None, half_scores: HalfScores | None = None):
    """HF eager's arithmetic in float32: score bias, softcap, mask, softmax with each head's sink logit, then values.

    q [G, n, Hq, D], k/v [G, L, Hkv, D], `allowed` and `bias` (float32: ALiBi's, relative logits') broadcast
    to [G, Hkv, R, n, L], `sinks` [Hq] (one per head: gpt-oss, Granite SWA) or [G, n, Hq] (one per query and
    head: Inkling 2) or None. A sink is one more logit in each query's softmax whose probability is dropped.
    """
    num, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    grouped_q = q.view(num, q_len, num_kv_heads, group, head_dim)  # [G, n, Hkv, R, D]
    qk = torch.einsum("bnkrd,blkd->bkrnl", grouped_q.float(), k.float())  # [G, Hkv, R, n, L]
    scores = _half_scores(qk, scaling, softcap, bias, half_scores, q.dtype)  # [G, Hkv, R, n, L]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        if sinks.dim() == 1:  # [G, Hkv, R, n, 1] as the per-query case below
            sink_logits = sinks.float().view(1, num_kv_heads, group, 1, 1).expand(num, -1, -1, q_len, 1)
        else:
            sink_logits = sinks.float().view(num, q_len, num_kv_heads, group).permute(0, 2, 3, 1)[..., None]
        probs = torch.cat([scores, sink_logits], dim=-1).softmax(dim=-1)[..., :-1]
    if half_scores is not None:  # HF's eager code weighs the values with probabilities in the model's dtype
        probs = probs.to(q.dtype).float()
    out = torch.einsum("bkrnl,blkd->bnkrd", probs, v.float())  # [G, n, Hkv, R, Dv]
    return out.reshape(num, q_len, num_q_heads, -1).to(q.dtype)
