"""The seam between HF attention modules and the engine's KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from nnrun.attention.score_terms import ScoreTerms
from nnrun.forward_batch import ForwardBatch
from nnrun.memory import KVPool


@dataclass(frozen=True)
class DecodeOps:
    """A layer's decode attention call as plain tensor ops, for a CPU decode graph to trace (`traced_graph`).

    `run(q, k, v, *inputs)` makes the call's ops with no Python branch and no shape fixed but the batch's, so
    a trace of it serves every KV length; `inputs()` are the step's tensors it reads (slots, masks, the pool),
    fetched at each replay from the backend's plan. `fits()` says whether the step's plan is one `run` serves
    (else the replay makes the ordinary call).
    """

    run: Callable[..., torch.Tensor]
    inputs: Callable[[], list[torch.Tensor]]
    fits: Callable[[], bool]


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
        terms: ScoreTerms,
    ) -> torch.Tensor:  # [N, Hq, Dv]
        ...

    def decode_ops(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, terms: ScoreTerms
    ) -> DecodeOps | None:
        """This layer's decode call (on these example tensors) as ops a CPU decode graph may trace, or None."""
        return None

    # ---- CUDA graphs (decode steps only) ---------------------------------------------------
    # A backend that can run inside a captured graph plans into buffers at fixed addresses: the
    # graph runner allocates them once, captures one graph per padded batch size, and before each
    # replay re-plans the step into the buffers that graph reads.

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether this backend's kernels can be captured inside a CUDA graph."""
        return False

    @property
    def plans_graph_steps(self) -> bool:
        """Whether this backend plans graph steps (the three methods below): its calls may run inside a
        captured graph (`supports_cuda_graphs`) or eagerly between graph pieces (`traced_graph`)."""
        return self.supports_cuda_graphs

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
