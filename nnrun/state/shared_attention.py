"""Attention modules shared by several layers and told their layer by argument (Zamba2's shared transformer block).

Zamba2 runs one attention module (HF gives it `layer_idx = -1`) in each of its hybrid layers, and
passes the calling layer's index to `forward(hidden_states, layer_idx, ...)` for HF's cache.
nnrun's attention pages one KV cache per `module.layer_idx`: so while such a module runs, its
`layer_idx` is the one it was told, and afterwards it is HF's again.
"""

from __future__ import annotations

import types

import torch

SHARED_ATTENTION = ("Zamba2Attention",)  # class names
_ADAPTED = "_nnrun_shared_attention"


def adapt_shared_attention(model: torch.nn.Module) -> None:
    """Give every shared attention module of `model` the layer it is called for (idempotent)."""
    for module in model.modules():
        if type(module).__name__ in SHARED_ATTENTION and not getattr(module, _ADAPTED, False):
            # A method bound to the module (not a closure over it): a deep copy of the model rebinds it to the copy.
            module.forward = types.MethodType(_forward_as_told_layer, module)
            setattr(module, _ADAPTED, True)


def _forward_as_told_layer(self: torch.nn.Module, hidden_states: torch.Tensor, layer_idx: int, *args, **kwargs):
    held = self.layer_idx
    self.layer_idx = layer_idx
    try:
        return type(self).forward(self, hidden_states, layer_idx, *args, **kwargs)
    finally:
        self.layer_idx = held
