"""The seam between HF attention modules and the engine's KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from nnrun.forward_batch import ForwardBatch
from nnrun.memory import KVPool


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged pool and attends each request over its whole KV.

    `init_forward_metadata` is called once per step, before the model runs, and may plan anything
    it needs (masks, page tables); `forward` is then called once per attention layer.
    """

    name: str = "base"

    def __init__(self, kv_pool: KVPool, device: torch.device) -> None:
        self.kv_pool = kv_pool
        self.device = device

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [N, Hq, D]
        k: torch.Tensor,  # [N, Hkv, D]
        v: torch.Tensor,  # [N, Hkv, Dv]
        scaling: float,
        sliding_window: int | None,
        softcap: float | None,
        # one extra softmax logit, its probability dropped: [Hq] one per head, or [N, Hq] one per query (Inkling 2)
        sinks: torch.Tensor | None = None,
        chunk_size: int | None = None,  # chunked attention: a query sees only keys of its own chunk
        # ALiBi: [Hq] float32 slopes; `slope * (key_pos - query_pos)` joins each scaled logit (Bloom, MPT, Falcon)
        alibi_slopes: torch.Tensor | None = None,
        # DSA sparse attention: [N, K] int64 request-local positions of each query's picked keys (-1: none);
        # a query sees only those of its causal keys
        key_indices: torch.Tensor | None = None,
        # Relative logits (Inkling): [N, Hq, E] each query's logit for a key d = query_pos - key_pos back,
        # 0 <= d < E (0 at other distances), joining its scaled scores
        relative_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [N, Hq, Dv]
        ...

    # ---- CUDA graphs (decode steps only) ---------------------------------------------------
    # A backend that can run inside a captured graph plans into buffers at fixed addresses: the
    # graph runner allocates them once, captures one graph per padded batch size, and before each
    # replay re-plans the step into the buffers that graph reads.

    @property
    def supports_cuda_graphs(self) -> bool:
        return False

    def init_cuda_graph_state(self, batch_sizes: Sequence[int]) -> None:
        """Allocate the fixed buffers and per-size kernels of every graph, once, before capture."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run inside CUDA graphs")

    def init_forward_metadata_capture(self, batch_size: int, out_cache_loc: torch.Tensor) -> None:
        """Plan a decode step of `batch_size` padding requests, for capture; `out_cache_loc` is the graph's own."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run inside CUDA graphs")

    def init_forward_metadata_replay(
        self, batch_size: int, forward_batch: ForwardBatch, out_cache_loc: torch.Tensor
    ) -> None:
        """Plan `forward_batch` (a decode step, padded to `batch_size`) into the buffers its graph reads."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run inside CUDA graphs")
