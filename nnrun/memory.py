"""KV memory: the paged per-layer pools, the page allocator and the request -> slots table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nnrun.request import Request


class TokenToKVPoolAllocator:
    """Hands out KV pages; a token's slot is `page * page_size + offset` in every layer's pool.

    CPU bookkeeping only. `alloc` returns None instead of raising when the pool is exhausted, and
    `free` ignores pages that are already free, so a double free cannot hand one page to two requests.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._is_free = [True] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_tokens(self) -> int:
        return self.num_free_pages * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_pages: int) -> list[int] | None:
        if num_pages > len(self._free_pages):
            return None
        pages = [self._free_pages.pop() for _ in range(num_pages)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if not self._is_free[page]:
                self._is_free[page] = True
                self._free_pages.append(page)

    def check_no_leaks(self) -> None:
        """Raise if any page is still held (call when no request is alive)."""
        held = self.num_pages - self.num_free_pages
        if held:
            raise AssertionError(f"KV leak: {held} of {self.num_pages} pages are still allocated")


class ReqToTokenPool:
    """One row per live request: the KV slot of each of its tokens, in token order."""

    def __init__(self, max_num_reqs: int, max_context_len: int) -> None:
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_num_reqs, max_context_len), dtype=torch.int64)  # [rows, max_len] (CPU)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if row not in self._free_rows:
            self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + slots.numel()] = slots

    def slots(self, row: int, end: int) -> torch.Tensor:
        return self.req_to_token[row, :end]


@dataclass(frozen=True)
class LayerKVShape:
    """What one attention layer stores per token; read off the model by the load-time probe."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int


class KVPool:
    """Per-layer K and V pages, NHD layout `[num_pages + 2, page_size, num_kv_heads, head_dim]`.

    Pages `0..num_pages-1` are the allocator's. Two more are never handed out: `trash_page`, where
    the padded rows of a replayed CUDA graph write their K/V and attend; and `zero_page`, which
    nothing ever writes, so padding that points at it reads keys and values of exactly zero: a
    masked zero key scores -inf and its zero value adds nothing, whatever the rest of the pool holds.
    """

    def __init__(
        self, layer_shapes: list[LayerKVShape], num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.trash_page = num_pages
        self.zero_page = num_pages + 1
        self.k_pages = [
            torch.zeros((num_pages + 2, page_size, s.num_kv_heads, s.head_dim), dtype=dtype, device=device)
            for s in layer_shapes
        ]
        self.v_pages = [
            torch.zeros((num_pages + 2, page_size, s.num_kv_heads, s.v_head_dim), dtype=dtype, device=device)
            for s in layer_shapes
        ]
        # Token-slot views of each layer's pages, made once: every layer call of every step reads them
        self._k_flats = [pages.flatten(0, 1) for pages in self.k_pages]  # each [slots, Hkv, D]
        self._v_flats = [pages.flatten(0, 1) for pages in self.v_pages]  # each [slots, Hkv, Dv]

    @property
    def trash_slot(self) -> int:
        return self.trash_page * self.page_size

    @property
    def zero_slot(self) -> int:
        return self.zero_page * self.page_size

    @property
    def num_layers(self) -> int:
        return len(self.k_pages)

    def k_flat(self, layer_idx: int) -> torch.Tensor:
        return self._k_flats[layer_idx]  # [slots, Hkv, D]

    def v_flat(self, layer_idx: int) -> torch.Tensor:
        return self._v_flats[layer_idx]  # [slots, Hkv, Dv]

    def write(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k: [N, Hkv, D], v: [N, Hkv, Dv], slots: [N]. The cache keeps values, never autograd history."""
        k_flat, v_flat = self._k_flats[layer_idx], self._v_flats[layer_idx]
        if k.requires_grad or k.dtype != k_flat.dtype or v.requires_grad or v.dtype != v_flat.dtype:
            k, v = k.detach().to(k_flat.dtype), v.detach().to(v_flat.dtype)  # (checked first: a no-op `to` costs ~1 us)
        k_flat.index_copy_(0, slots, k)
        v_flat.index_copy_(0, slots, v)

    @staticmethod
    def bytes_per_token(layer_shapes: list[LayerKVShape], dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(s.num_kv_heads * (s.head_dim + s.v_head_dim) for s in layer_shapes) * itemsize


def hold_kv(
    req: "Request", num_tokens: int, allocator: TokenToKVPoolAllocator, req_to_token_pool: ReqToTokenPool
) -> bool:
    """Give `req` a table row and pages for `num_tokens` tokens; False (nothing newly held) if they don't fit."""
    if req.req_pool_idx is None:
        row = req_to_token_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
    missing = allocator.pages_needed(num_tokens) - len(req.page_ids)
    if missing > 0:
        pages = allocator.alloc(missing)
        if pages is None:
            if not req.page_ids:
                req_to_token_pool.free(req.req_pool_idx)
                req.req_pool_idx = None
            return False
        req.page_ids.extend(pages)
    return True


def release_kv(req: "Request", allocator: TokenToKVPoolAllocator, req_to_token_pool: ReqToTokenPool) -> None:
    """Free a request's pages and table row; its cache is gone, so nothing counts as computed (safe twice)."""
    allocator.free(req.page_ids)
    req.page_ids = []
    if req.req_pool_idx is not None:
        req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
    req.num_computed_tokens = 0
