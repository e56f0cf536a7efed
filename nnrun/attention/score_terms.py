"""ScoreTerms: what shapes one attention call's scores besides q, k, v and the causal mask, as HF's module passes it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import torch


class HalfScores(Enum):
    """Where HF's half-precision eager code rounds a layer's scores and probabilities to the model's dtype.

    Float32 runs ignore it. Otherwise nnrun's scores stay float32, near what HF's sdpa gives; layers that
    HF runs in its eager code (ALiBi's, softcapped ones) round where it rounds: at long prompts ALiBi's bias
    is large (slope x position ~100), where one bf16 step is ~1 nat, and a softcap's tanh adds its own steps.
    """

    # One baddbmm: any bias (Bloom's, at key positions) rounded, plus scaled q.k, rounded once (Bloom,
    # GPT-NeoX-Japanese, whose bias is zeros)
    BIAS_THEN_ROUND = "bias then round"
    EAGER = "eager"  # q.k, its scaling and softcap each rounded, then any bias in float32 (MPT, Gemma 2's softcap)


@dataclass(frozen=True)
class ScoreTerms:
    """A layer's settings (the same for every query) and its per-query terms (one row per query, `[N, ...]`)."""

    scaling: float
    sliding_window: int | None = None  # a query sees only the last `sliding_window` keys
    softcap: float | None = None  # scores pass through tanh(scores / softcap) * softcap (Gemma 2)
    # one extra softmax logit whose probability is dropped: [Hq] one per head, or [N, Hq] one per query (Inkling 2)
    sinks: torch.Tensor | None = None
    chunk_size: int | None = None  # chunked attention: a query sees only keys of its own chunk (Llama 4)
    # ALiBi: [Hq] float32 slopes; `slope * (key_pos - query_pos)` joins each scaled score (Bloom, MPT, Falcon)
    alibi_slopes: torch.Tensor | None = None
    half_scores: HalfScores | None = None  # how HF rounds the scores in half precision (Bloom, MPT, softcaps)
    # HF's own eager attention of a layer that HF runs only in it (attention sinks: gpt-oss, Flint, Granite SWA,
    # Inkling 2), bound to its module: `(query [G, Hq, n, D], key, value [G, Hkv, L, D], additive mask,
    # scaling=..., position_bias=[G, Hq, n, L], sinks=[G, Hq, n, 1])` -> `(out [G, n, Hq, Dv], weights)`, the
    # last two (Inkling 2's relative logits and per-query sinks, dense as HF passes them) only where given.
    # Each such file rounds in its own places, its matmuls too: in half precision the torch backend runs it
    # on each group's gathered keys, so that the rounding is HF's.
    half_eager: Callable | None = None
    # The values are this many equal parts on the last dim that HF attends in separate calls (DiffLlama's two
    # halves, joined so that the pool keeps one V): half-precision kernels round each call as its own
    num_value_parts: int = 1
    # DSA sparse attention: [N, K] int64 request-local positions of each query's picked keys (-1: none);
    # a query sees only those of its causal keys
    key_indices: torch.Tensor | None = None
    # relative logits (Inkling): [N, Hq, E] each query's logit for a key d = query_pos - key_pos back,
    # 0 <= d < E (0 at other distances), joining its scaled scores
    relative_logits: torch.Tensor | None = None

    def rounds_as_hf_eager(self, dtype: torch.dtype) -> bool:
        """Whether, in `dtype`, HF's own code rounds these scores where the backend's plain kernels would not."""
        return dtype != torch.float32 and (self.half_scores is not None or self.half_eager is not None)

    @property
    def per_query_sinks(self) -> bool:
        return self.sinks is not None and self.sinks.dim() == 2

    def of_queries(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> ScoreTerms:
        """These terms for some of the queries: `rows` takes them from each `[N, ...]` per-query term."""
        return replace(
            self,
            sinks=rows(self.sinks) if self.per_query_sinks else self.sinks,
            key_indices=None if self.key_indices is None else rows(self.key_indices),
            relative_logits=None if self.relative_logits is None else rows(self.relative_logits),
        )
