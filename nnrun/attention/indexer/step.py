"""One packed step's indexers: each request's top-k keys, picked by HF's own indexer from that request's keys only.

HF's DSA indexer (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2) scores a query against every key its cache
hands back (`past_key_values.update_indexer`), masks the scores with the attention mask and keeps the
top `index_topk`. A packed step has neither a per-request cache nor a mask, and one top-k over the
flat batch would pick other requests' keys. So the step runs HF's indexer once per group of requests
of one shape (prefix length, new tokens), as HF alone runs each of them: the group's rows, a
bottom-right causal mask over each request's own `prefix + new` keys, and for `past_key_values` a
stand-in whose `update_indexer` stores the new keys in the indexer key pool and returns the
request's whole history from it. Decode steps run once, over every request's keys padded to the
longest. The picks are request-local key positions, which is what the paged attention needs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from nnrun.attention.context import indexer_step_context
from nnrun.attention.indexer.keys import IndexerKeyPool
from nnrun.attention.masks import allowed_keys
from nnrun.attention.step_layout import ExtendGroup, extend_groups, padded_decode_slots
from nnrun.forward_batch import ForwardBatch, ForwardMode

NO_KEY = -1  # a pick that names no key: past a request's own keys (its rows are padded to the step's widest)


class _RequestKeys:
    """HF's `past_key_values` as the indexer uses it: `update_indexer` keeps new keys and returns the history."""

    def __init__(self, pool: IndexerKeyPool, new_slots: torch.Tensor, kv_slots: torch.Tensor | None) -> None:
        self.pool = pool
        self.new_slots = new_slots  # [G * n] where the new keys go
        self.kv_slots = kv_slots  # [G, L] each request's whole history; None when it is all this step's

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:  # [G, n, D] -> [G, L, D]
        self.pool.write(layer_idx, self.new_slots, keys.reshape(-1, keys.shape[-1]))
        if self.kv_slots is None:  # a first prefill: HF's cache returns exactly the new keys
            return keys
        return self.pool.read(layer_idx, self.kv_slots).to(keys.dtype)


IndexerForward = Callable[..., torch.Tensor]  # HF's `Indexer.forward`, unbound


@dataclass
class IndexerStep:
    """The layout one packed step's indexers run in, built once per step on the host."""

    pool: IndexerKeyPool
    mode: ForwardMode
    out_cache_loc: torch.Tensor  # [N] int64 on the device
    extend_groups: list[ExtendGroup]
    decode_slots: torch.Tensor | None = None  # [B, L] int64, padding at the zero slot
    decode_seq_lens: torch.Tensor | None = None  # [B] int64

    @classmethod
    def for_batch(cls, pool: IndexerKeyPool, forward_batch: ForwardBatch, device: torch.device) -> IndexerStep:
        out_cache_loc = forward_batch.out_cache_loc.to(device)
        if forward_batch.forward_mode is ForwardMode.DECODE:
            seq_lens = torch.tensor(forward_batch.seq_lens, dtype=torch.int64)  # [B]
            slots = padded_decode_slots(forward_batch, seq_lens, pool.zero_slot)  # [B, L]
            return cls(pool, ForwardMode.DECODE, out_cache_loc, [], slots.to(device), seq_lens.to(device))
        return cls(pool, ForwardMode.EXTEND, out_cache_loc, extend_groups(forward_batch, device))

    def run(
        self,
        indexer: torch.nn.Module,
        hf_forward: IndexerForward,
        hidden_states: torch.Tensor,  # [1, N, H]
        q_resid: torch.Tensor,  # [1, N, R]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [1, N, d]
        position_ids: torch.Tensor | None,  # [1, N]
    ) -> torch.Tensor:  # [1, N, K] int32 request-local key positions, NO_KEY past a request's own
        inputs = (hidden_states, q_resid, *position_embeddings)
        if self.mode is ForwardMode.DECODE:
            return self._decode(indexer, hf_forward, inputs, position_ids)
        picks, rows = [], []
        for group in self.extend_groups:
            hidden, resid, cos, sin = (_group_rows(x, group) for x in inputs)
            positions = None if position_ids is None else _group_rows(position_ids, group)
            kv_len = group.prefix_len + group.q_len
            q_pos = torch.arange(group.prefix_len, kv_len, device=hidden.device)[:, None]  # [n, 1]
            kv_pos = torch.arange(kv_len, device=hidden.device)[None, :]  # [1, L]
            mask = allowed_keys(q_pos, kv_pos, None, None).expand(group.size, -1, -1)  # [G, n, L]
            new_slots = _group_rows(self.out_cache_loc[None], group).flatten()  # [G * n]
            keys = _RequestKeys(self.pool, new_slots, group.kv_slots)
            group_picks = hf_forward(indexer, hidden, resid, (cos, sin), mask, positions, past_key_values=keys)
            picks.append(group_picks.reshape(-1, group_picks.shape[-1]))  # [G * n, K_g]
            rows.append(_group_token_indices(group, hidden.device))
        return _scatter_rows(picks, rows, hidden_states.shape[1])

    def _decode(self, indexer, hf_forward, inputs, position_ids) -> torch.Tensor:
        hidden, resid, cos, sin = (x[0][:, None] for x in inputs)  # each request's one token: [B, 1, ...]
        positions = None if position_ids is None else position_ids[0][:, None]  # [B, 1]
        kv_pos = torch.arange(self.decode_slots.shape[1], device=hidden.device)  # [L]
        mask = (kv_pos[None, :] < self.decode_seq_lens[:, None])[:, None, :]  # [B, 1, L]: its own keys, all before it
        keys = _RequestKeys(self.pool, self.out_cache_loc, self.decode_slots)
        picks = hf_forward(indexer, hidden, resid, (cos, sin), mask, positions, past_key_values=keys)  # [B, 1, K]
        # A request with fewer keys than K gets the padding's too, scored -inf: they name no key.
        past_end = picks >= self.decode_seq_lens[:, None, None]
        return picks.masked_fill(past_end, NO_KEY).transpose(0, 1)  # [1, B, K]


def _group_rows(x: torch.Tensor, group: ExtendGroup) -> torch.Tensor:
    """A `[1, N, ...]` step tensor's rows of one group, as HF's `[G, n, ...]` batch."""
    return group.rows(x[0])


def _group_token_indices(group: ExtendGroup, device: torch.device) -> torch.Tensor:
    if group.token_indices is not None:
        return group.token_indices
    span = group.token_span
    return torch.arange(span.start, span.stop, device=device)  # [G * n]


def _scatter_rows(picks: list[torch.Tensor], rows: list[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """The groups' picks in the step's token order, `[1, N, K]`: narrower groups padded with NO_KEY."""
    if len(picks) == 1 and picks[0].shape[0] == num_tokens and rows[0].numel() == num_tokens:
        return picks[0][None]  # one group of every token, in order
    width = max(p.shape[1] for p in picks)
    out = picks[0].new_full((num_tokens, width), NO_KEY)  # [N, K]
    for group_picks, group_rows in zip(picks, rows):
        out[group_rows, : group_picks.shape[1]] = group_picks
    return out[None]


@contextmanager
def serve_indexers(pool: IndexerKeyPool | None, forward_batch: ForwardBatch, device: torch.device) -> Iterator[None]:
    """Around one packed forward: its indexers pick each request's keys from the pool's rows."""
    if pool is None:
        yield
        return
    with indexer_step_context(IndexerStep.for_batch(pool, forward_batch, device)):
        yield
