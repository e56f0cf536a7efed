"""Choosing the attention backend for a device."""

from __future__ import annotations

import logging

import torch

from nnrun.attention.base import AttentionBackend
from nnrun.attention.torch_backend import TorchAttnBackend
from nnrun.memory import KVPool

logger = logging.getLogger(__name__)


def create_attention_backend(name: str, kv_pool: KVPool, device: torch.device, layers: list) -> AttentionBackend:
    """`name` is "auto", "torch" or "flashinfer".

    "auto" takes FlashInfer on CUDA when it is installed and the cache is fp16/bf16 (its kernels
    exist only for those); everything else runs on the torch backend.
    """
    half = kv_pool.k_pages and kv_pool.k_pages[0].dtype in (torch.float16, torch.bfloat16)
    if name == "flashinfer" or (name == "auto" and device.type == "cuda" and half and _flashinfer_available()):
        if device.type != "cuda":
            raise ValueError(f"DeviceConfig.attention_backend='flashinfer' needs a CUDA device, got {device}")
        if not _flashinfer_available():
            raise ValueError("DeviceConfig.attention_backend='flashinfer' but flashinfer is not installed "
                             "(pip install 'nnrun[gpu]')")
        from nnrun.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(kv_pool, device, layers)
    return TorchAttnBackend(kv_pool, device)


def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True
