"""Attention probabilities for the requests of a packed step that ask for them (HF's output_attentions).

A packed step has no `[B, H, T, T_kv]` tensor, and the fast kernels never form the probabilities.
So for the requests that asked (`ForwardBatch.attention_probs_rows`) the HF glue recomputes them
after the backend has attended: from the same query and from the request's keys in the paged
pool (which the backend has just written), the way HF's eager attention does: `QK^T * scaling`,
the ALiBi bias or relative logits, the tanh softcap, the bottom-right causal and sliding-window mask, softmax in float32, cast back
to the model's dtype. The fast path's output is never touched, so the other requests of the step
are bitwise what they would be if nobody asked.

The columns are the keys HF's own cache hands eager attention: the whole history on full layers,
and on a sliding layer (whose `DynamicSlidingWindowLayer` keeps the last `window - 1` keys) the
keys from `max(0, prefix_len - window + 1)` on. So a generation step's shape is
`[1, H, 1, min(seq_len, window)]` there, exactly as HF eager shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from nnrun.attention.masks import alibi_bias, allowed_keys, relative_position_bias, selected_keys
from nnrun.attention.score_terms import ScoreTerms
from nnrun.forward_batch import ForwardBatch
from nnrun.memory import KVPool


class AttentionProbs:
    """One attention layer's second output in a packed step: per batch row, that request's probabilities.

    Only the rows that asked have an entry, `[1, Hq, q_len, kv_len]`; the interleaver serves each
    request its own entry, or None (what HF's sdpa returns) when it did not ask.
    """

    def __init__(self, by_row: dict[int, torch.Tensor]) -> None:
        self.by_row = by_row

    def for_row(self, row: int) -> torch.Tensor | None:
        return self.by_row.get(row)

    def replaced(self, by_row: dict[int, torch.Tensor | None]) -> AttentionProbs:
        """A copy with some rows' entries replaced (None drops an entry); this one is left as it is."""
        merged = dict(self.by_row)
        for row, value in by_row.items():
            if value is None:
                merged.pop(row, None)
            else:
                merged[row] = value
        return AttentionProbs(merged)

    def __repr__(self) -> str:
        shapes = {row: tuple(t.shape) for row, t in self.by_row.items()}
        return f"AttentionProbs({shapes})"


@dataclass
class _AskingRequest:
    row: int  # batch row
    q_start: int  # first flat index of its new tokens
    q_len: int
    prefix_len: int
    kv_slots: torch.Tensor  # [seq_len] int64 on the device: its whole KV after this step
    # (window, chunk) -> (slots, mask, key_pos - query_pos [n, L]): the same for every layer of that kind in a step
    by_window: dict = field(default_factory=dict)

    def keys(
        self, sliding_window: int | None, chunk_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The slots of the keys HF's cache holds for this layer kind, the mask over them (None: all allowed)
        and each key's distance from each query (float32, for ALiBi)."""
        kind = (sliding_window, chunk_size)
        if kind not in self.by_window:
            seq_len = self.prefix_len + self.q_len
            kv_start = 0 if sliding_window is None else max(0, self.prefix_len - sliding_window + 1)
            device = self.kv_slots.device
            q_pos = torch.arange(self.prefix_len, seq_len, device=device)[:, None]  # [n, 1]
            kv_pos = torch.arange(kv_start, seq_len, device=device)[None, :]  # [1, L]
            allowed = allowed_keys(q_pos, kv_pos, sliding_window, chunk_size)  # [n, L]
            # one query sees every key it is given (the window's), unless chunks hide some of them
            mask = None if self.q_len == 1 and chunk_size is None else allowed
            self.by_window[kind] = (self.kv_slots[kv_start:], mask, (kv_pos - q_pos).float())
        return self.by_window[kind]


@dataclass
class AttentionProbsPlan:
    """The step's requests that asked, with where their queries and keys are; built once per step."""

    requests: list[_AskingRequest]
    # On a tensor-parallel rank, which holds only its share of the heads: `[1, Hq_local, n, L]` -> `[1, Hq, n, L]`.
    gather_heads: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def for_batch(
        cls,
        forward_batch: ForwardBatch,
        device: torch.device,
        gather_heads: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> AttentionProbsPlan | None:
        """None when no request of the step asked (the common case: nothing is computed)."""
        rows = forward_batch.attention_probs_rows
        if not rows:
            return None
        return cls(
            [
                _AskingRequest(
                    row,
                    forward_batch.extend_start_loc[row],
                    forward_batch.extend_seq_lens[row],
                    forward_batch.prefix_lens[row],
                    forward_batch.kv_slots[row].to(device),
                )
                for row in rows
            ],
            gather_heads,
        )

    def compute(self, kv_pool: KVPool, layer_idx: int, q: torch.Tensor, terms: ScoreTerms) -> AttentionProbs:
        """`q` is the step's `[N, Hq, D]` queries; the layer's keys are already in the pool.

        `key_indices` (`[N, K]`, DSA sparse attention) leaves each query only its indexer's picks, as HF
        folds them into eager's mask. `relative_logits` (`[N, Hq, E]`, Inkling) add each query's logit by distance.
        """
        k_flat = kv_pool.k_flat(layer_idx)  # [num_slots, Hkv, D]
        by_row = {}
        for req in self.requests:
            own = terms.of_queries(lambda x: x[req.q_start : req.q_start + req.q_len])  # this request's queries
            slots, mask, distance = req.keys(own.sliding_window, own.chunk_size)
            bias = None if own.alibi_slopes is None else alibi_bias(own.alibi_slopes, k_flat.shape[1], distance)
            if own.relative_logits is not None:
                by_distance = relative_position_bias(
                    own.relative_logits.transpose(0, 1), k_flat.shape[1], -distance.long()
                )  # [Hkv, R, n, L]
                bias = by_distance if bias is None else bias + by_distance
            if own.key_indices is not None:  # [n, L]: picks are positions from 0, and DSA layers keep every key
                picked = selected_keys(own.key_indices, slots.shape[0])
                mask = picked if mask is None else mask & picked
            by_row[req.row] = _eager_probs(
                q[req.q_start : req.q_start + req.q_len],
                k_flat.index_select(0, slots),
                mask,
                own.scaling,
                own.softcap,
                own.sinks,
                bias,
            )
            if self.gather_heads is not None:
                by_row[req.row] = self.gather_heads(by_row[req.row])
        return AttentionProbs(by_row)


def _eager_probs(
    q: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """HF eager's softmax for one request: q `[n, Hq, D]`, keys `[L, Hkv, D]`, mask `[n, L]` -> `[1, Hq, n, L]`.

    `bias` (`[Hkv, G, n, L]` float32: ALiBi's, relative logits') joins the scaled scores, computed then
    in float32 as the ALiBi families' HF attention softmaxes them.

    With attention sinks (`[Hq]`, or `[n, Hq]` one per query: Inkling 2), each head's sink logit joins
    the softmax and its probability is dropped, as the sink families' eager attention returns them.
    """
    num_q, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped_q = q.view(num_q, num_kv_heads, num_q_heads // num_kv_heads, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    scores = torch.matmul(grouped_q, keys.permute(1, 2, 0)[:, None]) * scaling  # [Hkv, G, n, L] (HF's repeat_kv)
    if bias is not None:
        scores = scores.float() + bias
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        if sinks.dim() == 1:
            sink_logits = sinks.view(num_kv_heads, -1, 1, 1).to(scores.dtype).expand(-1, -1, num_q, 1)  # [Hkv, G, n, 1]
        else:
            sink_logits = sinks.T.reshape(num_kv_heads, -1, num_q, 1).to(scores.dtype)  # [Hkv, G, n, 1]
        scores = torch.cat([scores, sink_logits], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [Hkv, G, n, L (+1)]
    if sinks is not None:
        probs = probs[..., :-1]
    return probs.reshape(1, num_q_heads, num_q, -1)  # [1, Hq, n, L]
