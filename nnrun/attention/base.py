"""The seam between HF attention modules and the engine's KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

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
    ) -> torch.Tensor:  # [N, Hq, Dv]
        ...
