"""Host-side planning for FlashInfer: CSR page tables per step and plan groups per model.

Pure functions over CPU data, no flashinfer import, so every invariant FlashInfer relies on is
unit-tested on any machine. FlashInfer's paged layout (0.7.2) for a batch of B requests:

- `qo_indptr [B+1]`: request b's new tokens are rows `qo_indptr[b]:qo_indptr[b+1]` of q;
- `kv_indptr [B+1]`, `kv_indices [kv_indptr[-1]]`: request b's pages, in token order, are
  `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` (page ids, not token slots);
- `kv_last_page_len [B]`, in 1..page_size: tokens used in the last page, so the KV length is
  `(num_pages - 1) * page_size + last_page_len` (flashinfer's `get_seq_lens`).

All four are int32. The KV of a request already includes this step's tokens (they are written
before attention), and the causal mask is bottom-right aligned, so new token j of a request with
`prefix_len` cached tokens sees positions `0..prefix_len + j`.

Chunked attention (a query sees only the keys of its own chunk of `chunk_size` positions) needs no
kernel support: each request is planned as one FlashInfer request per chunk its new tokens touch,
whose KV pages start at the chunk's first page. Bottom-right alignment then gives every query the
keys from its chunk's start up to itself. A page must not straddle two chunks (`chunk_size` a
multiple of `page_size`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from nnrun.forward_batch import ForwardBatch, ForwardMode
from nnrun.model_probe import AttentionLayerInfo


@dataclass(frozen=True)
class PlanGroup:
    """Layers that can share one FlashInfer plan: same heads, window, softcap and softmax scale.

    FlashInfer fixes `sm_scale`, `window_left` and `logits_soft_cap` at plan time (non-trtllm
    backends), so each distinct combination needs its own wrapper and its own `plan()` per step.
    """

    layer_ids: tuple[int, ...]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window_left: int  # inclusive left window; -1 attends the whole prefix
    logits_soft_cap: float | None  # cap * tanh(x / cap); None: no cap
    sm_scale: float
    chunk_size: int | None = None  # chunked attention: planned from the step's per-chunk page tables
    pos_encoding_mode: str = "NONE"  # "ALIBI": the kernel adds its built-in slopes times the key distance

    @property
    def has_decode_kernel(self) -> bool:
        """FlashInfer's decode wrapper takes one head_dim for q, k and v."""
        return self.head_dim == self.v_head_dim


def window_left_of(sliding_window: int | None) -> int:
    """HF keeps kv positions > q - W; FlashInfer's inclusive window keeps kv >= q - window_left."""
    if sliding_window is None:
        return -1
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    return sliding_window - 1


def group_layers(layers: Sequence[AttentionLayerInfo]) -> list[PlanGroup]:
    """Plan groups in order of first layer; each layer belongs to exactly one group."""
    members: dict[tuple, list[int]] = {}
    for layer in layers:
        key = (
            layer.num_q_heads,
            layer.kv_shape.num_kv_heads,
            layer.kv_shape.head_dim,
            layer.kv_shape.v_head_dim,
            window_left_of(layer.sliding_window),
            layer.softcap,
            float(layer.scaling),
            layer.chunk_size,
            "ALIBI" if layer.has_alibi else "NONE",
        )
        members.setdefault(key, []).append(layer.layer_idx)
    return [PlanGroup(tuple(ids), *key) for key, ids in members.items()]


def layer_to_group_index(groups: Sequence[PlanGroup], num_layers: int) -> list[int]:
    """`mapping[layer_idx]` is the index of the layer's group in `groups`."""
    mapping = [-1] * num_layers
    for index, group in enumerate(groups):
        for layer_idx in group.layer_ids:
            mapping[layer_idx] = index
    if -1 in mapping:
        raise ValueError(f"layers {[i for i, g in enumerate(mapping) if g < 0]} belong to no plan group")
    return mapping


@dataclass
class PagedKVPlan:
    """One step's FlashInfer page tables (CPU, int32) and the wrapper kind that runs it."""

    forward_mode: ForwardMode  # DECODE: the decode wrappers; EXTEND: the prefill wrappers
    page_size: int
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32, in pages
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32 page ids
    kv_last_page_len: torch.Tensor  # [B] int32, each in 1..page_size

    @property
    def batch_size(self) -> int:
        return int(self.kv_last_page_len.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    def seq_lens(self) -> torch.Tensor:
        """[B] int32 KV length of each request (flashinfer.get_seq_lens)."""
        num_pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (num_pages - 1) * self.page_size + self.kv_last_page_len


def plan_paged_kv(
    prefix_lens: Sequence[int],
    extend_seq_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    page_size: int,
    chunk_size: int | None = None,
) -> PagedKVPlan:
    """CSR page tables for requests with `prefix_lens` cached and `extend_seq_lens` new tokens.

    `page_tables[b]` lists request b's pages in token order; it may hold more pages than the
    request uses (only the first `ceil(seq_len / page_size)` are read). The mode is DECODE when
    every request brings one token after a non-empty prefix, EXTEND otherwise. With `chunk_size`,
    each request becomes one planned request per chunk its new tokens touch (see the module doc).
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if not len(prefix_lens) == len(extend_seq_lens) == len(page_tables):
        raise ValueError(
            f"{len(prefix_lens)} prefix lengths, {len(extend_seq_lens)} extend lengths and "
            f"{len(page_tables)} page tables: one of each per request is needed"
        )
    if chunk_size is not None and (chunk_size <= 0 or chunk_size % page_size):
        raise ValueError(f"chunk_size must be a positive multiple of page_size={page_size}, got {chunk_size}")
    qo_indptr, kv_indptr, kv_indices, last_page_lens = [0], [0], [], []
    for prefix_len, extend_len, pages in zip(prefix_lens, extend_seq_lens, page_tables):
        if prefix_len < 0 or extend_len <= 0:
            raise ValueError(
                f"each request needs prefix_len >= 0 and at least one new token, "
                f"got prefix_len={prefix_len}, extend_len={extend_len}"
            )
        seq_len = prefix_len + extend_len
        num_pages = -(-seq_len // page_size)
        if len(pages) < num_pages:
            raise ValueError(
                f"a request of {seq_len} tokens needs {num_pages} pages of {page_size}, its page table has {len(pages)}"
            )
        for kv_start, q_start, kv_end in _attended_spans(prefix_len, seq_len, chunk_size):
            first_page, end_page = kv_start // page_size, -(-kv_end // page_size)
            qo_indptr.append(qo_indptr[-1] + kv_end - q_start)
            kv_indptr.append(kv_indptr[-1] + end_page - first_page)
            kv_indices.extend(pages[first_page:end_page])
            last_page_lens.append(kv_end - (end_page - 1) * page_size)
    is_decode = bool(prefix_lens) and all(p > 0 and e == 1 for p, e in zip(prefix_lens, extend_seq_lens))
    return PagedKVPlan(
        forward_mode=ForwardMode.DECODE if is_decode else ForwardMode.EXTEND,
        page_size=page_size,
        qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32),  # [B+1]
        kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32),  # [B+1]
        kv_indices=torch.tensor(kv_indices, dtype=torch.int32),  # [sum of pages]
        kv_last_page_len=torch.tensor(last_page_lens, dtype=torch.int32),  # [B]
    )


def _attended_spans(prefix_len: int, seq_len: int, chunk_size: int | None) -> list[tuple[int, int, int]]:
    """`(kv_start, q_start, kv_end)` per planned request: new tokens `q_start..kv_end` see keys `kv_start..`."""
    if chunk_size is None:
        return [(0, prefix_len, seq_len)]
    return [
        (chunk_start, max(prefix_len, chunk_start), min(seq_len, chunk_start + chunk_size))
        for chunk_start in range(prefix_len - prefix_len % chunk_size, seq_len, chunk_size)
    ]


def plan_forward_batch(forward_batch: ForwardBatch, page_size: int, chunk_size: int | None = None) -> PagedKVPlan:
    """The page tables of one engine step, read from each request's `page_ids` (per chunk, with `chunk_size`).

    A step the runner labelled EXTEND stays EXTEND even if it happens to look like a decode. A large
    decode step with its request table's rows (`kv_slot_table`) is planned from them in whole-batch ops.
    """
    table = forward_batch.kv_slot_table
    if (
        forward_batch.forward_mode is ForwardMode.DECODE
        and chunk_size is None
        and table is not None
        and forward_batch.batch_size >= TABLE_PLAN_MIN_BATCH
    ):
        return plan_decode_from_table(table, forward_batch.positions, page_size)
    plan = plan_paged_kv(
        forward_batch.prefix_lens,
        forward_batch.extend_seq_lens,
        [req.page_ids for req in forward_batch.reqs],
        page_size,
        chunk_size,
    )
    if forward_batch.forward_mode is not ForwardMode.DECODE:
        plan.forward_mode = ForwardMode.EXTEND
    elif plan.forward_mode is not ForwardMode.DECODE:
        raise ValueError("a DECODE step must bring exactly one new token per request after a cached prefix")
    return plan


# From this many requests a decode step is planned from its table's rows: a few whole-batch ops (~25 us on a
# CPU) instead of Python per request (~0.5 us each).
TABLE_PLAN_MIN_BATCH = 48


def plan_decode_from_table(kv_slot_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> PagedKVPlan:
    """`plan_paged_kv`'s decode plan (no chunks) from the step's request-table rows, in whole-batch ops.

    `kv_slot_table` `[B, L]` holds each request's slots in its first `positions[b] + 1` columns (CPU int64),
    `positions` `[B]` each request's one new token. Page p of a request holds its tokens from `p * page_size`,
    so the slot in that column names the page.
    """
    seq_lens = positions + 1  # [B] int64
    num_pages = (seq_lens + page_size - 1) // page_size  # [B]
    pages = kv_slot_table[:, ::page_size] // page_size  # [B, max pages] each request's pages, stale past its last
    used = torch.arange(pages.shape[1]) < num_pages[:, None]  # [B, max pages]
    zero = torch.zeros(1, dtype=torch.int32)
    return PagedKVPlan(
        forward_mode=ForwardMode.DECODE,
        page_size=page_size,
        qo_indptr=torch.arange(len(seq_lens) + 1, dtype=torch.int32),  # [B+1]
        kv_indptr=torch.cat([zero, num_pages.cumsum(0).to(torch.int32)]),  # [B+1]
        kv_indices=pages.masked_select(used).to(torch.int32),  # [sum of pages], row by row
        kv_last_page_len=(seq_lens - (num_pages - 1) * page_size).to(torch.int32),  # [B]
    )


def pad_decode_plan(plan: PagedKVPlan, batch_size: int, trash_page: int) -> PagedKVPlan:
    """`plan` grown to `batch_size` requests for a captured CUDA graph of that size.

    Each padding request decodes one token over a single token of `trash_page` (a page the
    allocator never hands out), so the graph's fixed-size kernels run on valid indices and the
    padded rows can neither read nor write a real request's KV.
    """
    if plan.forward_mode is not ForwardMode.DECODE:
        raise ValueError("only decode steps are padded for CUDA graphs")
    num_pad = batch_size - plan.batch_size
    if num_pad < 0:
        raise ValueError(f"cannot pad a batch of {plan.batch_size} requests down to {batch_size}")
    one_each = torch.arange(1, num_pad + 1, dtype=torch.int32)  # [P] one query row and one page per padding row
    return PagedKVPlan(
        forward_mode=ForwardMode.DECODE,
        page_size=plan.page_size,
        qo_indptr=torch.cat([plan.qo_indptr, plan.qo_indptr[-1] + one_each]),  # [bs+1]
        kv_indptr=torch.cat([plan.kv_indptr, plan.kv_indptr[-1] + one_each]),  # [bs+1]
        kv_indices=torch.cat([plan.kv_indices, torch.full((num_pad,), trash_page, dtype=torch.int32)]),
        kv_last_page_len=torch.cat([plan.kv_last_page_len, torch.ones(num_pad, dtype=torch.int32)]),  # [bs]
    )


def flashinfer_unplanned_features(layers: list, page_size: int | None) -> str | None:
    """Why nnrun's FlashInfer backend cannot serve these layers, or None when it can.

    Attention sinks are applied from the kernel's log-sum-exp, which is that of the capped logits
    when a softcap is set: no family has both, and nnrun does not plan them together. Chunked
    attention is planned as one request per chunk, which needs chunks made of whole KV pages.
    FlashInfer's ALIBI mode takes no slopes from the caller: only layers whose slopes are its
    built-in ones (Bloom's and MPT's are; Falcon's are not) can use it. DSA sparse attention's
    per-query key picks (DeepSeek-V3.2) are not planned, nor Inkling's relative logits (a bias per
    query and distance, which no FlashInfer kernel adds): those models run on the torch backend.
    """
    other_slopes = [
        layer.layer_idx
        for layer in layers
        if layer.has_alibi and not _close(layer.alibi_slopes, flashinfer_alibi_slopes(layer.num_q_heads))
    ]
    if other_slopes:
        return (
            f"layers {other_slopes} have ALiBi slopes other than FlashInfer's built-in ones (Falcon divides "
            "them by sqrt(head_dim)), the only ones its ALIBI mode applies"
        )
    sparse_layers = [layer.layer_idx for layer in layers if getattr(layer, "has_key_indices", False)]
    if sparse_layers:
        return (
            f"layers {sparse_layers} attend only to the keys their sparse-attention indexer picks per query, "
            "which nnrun's FlashInfer backend does not plan"
        )
    relative_layers = [layer.layer_idx for layer in layers if getattr(layer, "has_relative_logits", False)]
    if relative_layers:
        return (
            f"layers {relative_layers} add relative logits per query and key distance (Inkling's relative position "
            "bias), which nnrun's FlashInfer backend does not apply"
        )
    capped_sink_layers = [layer.layer_idx for layer in layers if layer.has_sinks and layer.softcap is not None]
    if capped_sink_layers:
        return (
            f"layers {capped_sink_layers} have attention sinks and a softcap together, which nnrun's FlashInfer "
            "backend does not plan"
        )
    odd_chunks = sorted(
        {
            layer.chunk_size
            for layer in layers
            if layer.chunk_size is not None and (page_size is None or layer.chunk_size % page_size)
        }
    )
    if odd_chunks:
        return (
            f"attention chunks of {odd_chunks} tokens are not whole KV pages of {page_size} tokens, which "
            "nnrun's FlashInfer backend plans chunks from"
        )
    return None


def flashinfer_alibi_slopes(num_heads: int) -> list[float]:
    """The slopes FlashInfer's ALIBI mode uses (its `utils.get_alibi_slopes`): the ALiBi paper's, as Bloom's."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / closest) for i in range(1, closest + 1)]
    extra = [2.0 ** (-4.0 * i / closest) for i in range(1, 2 * (num_heads - closest), 2)]
    return slopes + extra


def _close(slopes: tuple[float, ...], expected: list[float]) -> bool:
    # Float32 slopes computed another way may differ from these in the last bit.
    return len(slopes) == len(expected) and all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(slopes, expected))
