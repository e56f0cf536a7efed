"""Choosing the attention backend for a device."""

from __future__ import annotations

import logging

import torch

from nnrun.attention.base import AttentionBackend
from nnrun.attention.flashinfer_plan import flashinfer_unplanned_features
from nnrun.attention.torch_backend import TorchAttnBackend
from nnrun.memory import KVPool

logger = logging.getLogger(__name__)

# FlashInfer's paged prefill/decode kernels are instantiated for these head dims only; any other
# (48, say) compiles but fails at run time with "Invalid configuration" (seen on an H100).
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def create_attention_backend(name: str, kv_pool: KVPool, device: torch.device, layers: list) -> AttentionBackend:
    """`name` is "auto", "torch" or "flashinfer".

    "auto" takes FlashInfer on CUDA when it is installed, the cache is fp16/bf16, every layer's
    head dim is one its kernels exist for and no layer needs what nnrun's FlashInfer backend does
    not plan (`flashinfer_unplanned_features`); everything else runs on the torch backend.
    """
    half = kv_pool.k_pages and kv_pool.k_pages[0].dtype in (torch.float16, torch.bfloat16)
    # Only the real kernels have the restriction (on CPU the backend runs under the tests' emulator).
    odd_head_dims = sorted(_head_dims(layers) - set(FLASHINFER_HEAD_DIMS)) if device.type == "cuda" else []
    unplanned = flashinfer_unplanned_features(layers, getattr(kv_pool, "page_size", None))
    auto_could_take_flashinfer = name == "auto" and device.type == "cuda" and half and _flashinfer_available()
    if auto_could_take_flashinfer and odd_head_dims:
        logger.info("head dims %s have no FlashInfer kernel: using the torch attention backend", odd_head_dims)
    if auto_could_take_flashinfer and unplanned:
        logger.info("%s: using the torch attention backend", unplanned)
    if name == "flashinfer" or (auto_could_take_flashinfer and not odd_head_dims and not unplanned):
        if unplanned:
            raise ValueError(f"DeviceConfig.attention_backend='flashinfer': {unplanned}; use attention_backend='torch'")
        if odd_head_dims:
            raise ValueError(
                f"DeviceConfig.attention_backend='flashinfer' runs head dims {FLASHINFER_HEAD_DIMS}, "
                f"this model has {odd_head_dims}; use attention_backend='torch'"
            )
        if device.type != "cuda":
            raise ValueError(f"DeviceConfig.attention_backend='flashinfer' needs a CUDA device, got {device}")
        if not _flashinfer_available():
            raise ValueError(
                "DeviceConfig.attention_backend='flashinfer' but flashinfer is not installed (pip install 'nnrun[gpu]')"
            )
        from nnrun.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(kv_pool, device, layers)
    return TorchAttnBackend(kv_pool, device)


def _head_dims(layers: list) -> set[int]:
    return {dim for layer in layers for dim in (layer.kv_shape.head_dim, layer.kv_shape.v_head_dim)}


def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True
