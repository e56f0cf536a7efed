"""How a step's requests meet the KV pool in torch: extend groups of one shape, and decode rows' padded KV slots.

Shared by the torch attention backend and the sparse-attention indexers, which lay their own keys
out the same way as the attention's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nnrun.forward_batch import ForwardBatch


@dataclass
class ExtendGroup:
    """Requests of one shape (prefix length, new tokens): attended in one batched kernel call."""

    prefix_len: int
    q_len: int
    q_starts: list[int]  # where each request's new tokens start in the flat batch
    # [G * q_len] int64 the group's new tokens; None when they are adjacent in the flat batch (one
    # request, or equal prompts traced together), which is then sliced and viewed, never gathered.
    token_indices: torch.Tensor | None
    kv_slots: torch.Tensor | None  # [G, prefix_len + q_len] int64; None when the KV is all this step's

    @property
    def token_span(self) -> slice:
        """The group's tokens when they are adjacent: request i at `start + i * q_len`."""
        return slice(self.q_starts[0], self.q_starts[0] + self.size * self.q_len)

    @property
    def size(self) -> int:
        return len(self.q_starts)

    def covers(self, num_tokens: int) -> bool:
        """Whether the group's tokens are all `num_tokens` of the step, in order (its output is the step's)."""
        return self.token_indices is None and self.q_starts[0] == 0 and self.size * self.q_len == num_tokens

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, ...]` per-token values -> the group's `[G, n, ...]` (a view when its tokens are adjacent)."""
        rows = x[self.token_span] if self.token_indices is None else x.index_select(0, self.token_indices)
        return rows.reshape(self.size, self.q_len, *x.shape[1:])


def padded_decode_slots(forward_batch: ForwardBatch, seq_lens: torch.Tensor, zero_slot: int) -> torch.Tensor:
    """[B, max_seq_len] int64 slots of each request's KV, padded with the pool's zero slot.

    Padding reads the zero page, never another request's or a freed page's KV (0 * NaN is NaN).
    """
    table = forward_batch.kv_slot_table
    if table is not None and rows_fill_table(forward_batch, table.shape[1]):  # nothing lies past a row's end
        return table
    if table is not None:  # the request table's rows, read once: mask what lies past each request's end
        past_end = torch.arange(table.shape[1]) >= seq_lens[:, None]  # [B, max_len]
        return table.masked_fill(past_end, zero_slot)
    padded = torch.full((len(seq_lens), int(seq_lens.max())), zero_slot, dtype=torch.int64)  # [B, max_len]
    for row, slots in enumerate(forward_batch.kv_slots):
        padded[row, : slots.numel()] = slots
    return padded


def rows_fill_table(forward_batch: ForwardBatch, width: int) -> bool:
    """Whether every request of a decode step has `width` tokens of KV (equal lengths: no padding at all)."""
    return min(forward_batch.prefix_lens, default=-1) + 1 == width


def extend_groups(forward_batch: ForwardBatch, device: torch.device) -> list[ExtendGroup]:
    """The step's requests grouped by (prefix length, new tokens), in order of first appearance."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for row, shape in enumerate(zip(forward_batch.prefix_lens, forward_batch.extend_seq_lens)):
        by_shape.setdefault(shape, []).append(row)
    groups = []
    for (prefix_len, q_len), rows in by_shape.items():
        starts = [forward_batch.extend_start_loc[row] for row in rows]
        token_indices = None
        if starts != list(range(starts[0], starts[0] + len(rows) * q_len, q_len)):
            token_indices = (torch.tensor(starts)[:, None] + torch.arange(q_len)).flatten().to(device)  # [G * n]
        kv_slots = None
        if prefix_len > 0:
            kv_slots = torch.stack([forward_batch.kv_slots[row] for row in rows]).to(device)  # [G, L]
        groups.append(ExtendGroup(prefix_len, q_len, starts, token_indices, kv_slots))
    return groups
