"""Attention backends behind one interface, and their registration with transformers."""

from nnrun.attention.base import AttentionBackend
from nnrun.attention.context import current_backend, forward_context
from nnrun.attention.hf_glue import ATTN_IMPLEMENTATION, hf_masks_skipped
from nnrun.attention.probabilities import AttentionProbs
from nnrun.attention.torch_backend import TorchAttnBackend

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionBackend",
    "AttentionProbs",
    "TorchAttnBackend",
    "current_backend",
    "forward_context",
    "hf_masks_skipped",
]
