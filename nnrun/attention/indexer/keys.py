"""The indexer key pool: each sparse-attention indexer's keys, paged like the KV cache beside it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nnrun.memory import KVPool


@dataclass(frozen=True)
class IndexerInfo:
    """One sparse-attention indexer: the attention layer it selects keys for, and its key width."""

    layer_idx: int
    head_dim: int


class IndexerKeyPool:
    """Per indexer, one key row per KV slot: a token's indexer key lives at the slot of its K and V.

    So the KV pool's page tables address both: a request's indexer keys are read through its
    `kv_slots`, written at the step's `out_cache_loc`, and freed with its pages. The rows are
    allocated with each KV pool (`allocate`), in the model's dtype, as HF's cache keeps them; the
    pool's zero page is never written, so padding that points there reads zeros. They are not in the
    KV pool's memory budget: `index_head_dim` values per token and indexer, about 0.3% of DeepSeek-V3.2's
    expanded MLA keys and values.
    """

    def __init__(self, indexers: list[IndexerInfo], dtype: torch.dtype, device: torch.device) -> None:
        self.indexers = indexers
        self.dtype = dtype
        self.device = device
        self.keys: dict[int, torch.Tensor] = {}  # layer_idx -> [num_slots, D]
        self.zero_slot = 0  # the KV pool's: padding reads it

    def allocate(self, kv_pool: KVPool) -> None:
        """Rows for every slot of `kv_pool` (replacing those of the pool before it)."""
        num_slots = kv_pool.k_flat(0).shape[0]
        self.zero_slot = kv_pool.zero_slot
        self.keys = {}  # the previous pool's rows go first, so both are never held together
        self.keys = {
            info.layer_idx: torch.zeros((num_slots, info.head_dim), dtype=self.dtype, device=self.device)
            for info in self.indexers
        }

    def write(self, layer_idx: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """keys `[n, D]` at slots `[n]`; the pool keeps values, never autograd history."""
        self.keys[layer_idx].index_copy_(0, slots, keys.detach().to(self.dtype))

    def read(self, layer_idx: int, slots: torch.Tensor) -> torch.Tensor:
        """The keys at `slots` (any shape `S`): `[*S, D]`."""
        table = self.keys[layer_idx]
        return table.index_select(0, slots.flatten()).view(*slots.shape, table.shape[1])
