"""KV-pool entries for mixer (and feed-forward-only) layers numbered between attention layers.

The KV pool and the attention backends index layers by `module.layer_idx`, contiguously from 0.
In a hybrid (Qwen3-Next: three linear-attention layers, then one attention layer) the mixer layers
in between call no attention and own no KV; each gets a placeholder that copies a real attention
layer's entry (so FlashInfer plans it in that layer's group, at no cost) and whose KV shape has
no heads (so its pages hold no bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nnrun.memory import LayerKVShape
from nnrun.model_probe import AttentionLayerInfo


@dataclass(frozen=True)
class StateLayerPlaceholder(AttentionLayerInfo):
    """A mixer layer's place among the attention layers: it never attends and owns no KV."""


# HF's `layer_types` for layers with neither attention nor state (its cache gives them a `DummyLayer`)
FEED_FORWARD_LAYER_TYPES = ("mlp", "moe")


def feed_forward_layer_ids(model: torch.nn.Module) -> frozenset[int]:
    """Layers the config declares as feed-forward only (Nemotron-H's MLP and MoE layers): no attention, no state."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None) or []
    return frozenset(i for i, layer_type in enumerate(layer_types) if layer_type in FEED_FORWARD_LAYER_TYPES)


def with_state_placeholders(layers: list[AttentionLayerInfo]) -> list[AttentionLayerInfo]:
    """`layers` (attention layers by `layer_idx`) with a placeholder at every index up to the last they skip."""
    if not layers:
        return []
    by_idx = {layer.layer_idx: layer for layer in layers}
    filled = []
    for layer_idx in range(max(by_idx) + 1):
        layer = by_idx.get(layer_idx)
        if layer is None:
            nearest = next(by_idx[i] for i in sorted(by_idx, key=lambda i: abs(i - layer_idx)))
            values = {f.name: getattr(nearest, f.name) for f in fields(nearest)}
            layer = StateLayerPlaceholder(**{**values, "layer_idx": layer_idx})
        filled.append(layer)
    return filled


def kv_shapes(layers: list[AttentionLayerInfo]) -> list[LayerKVShape]:
    """What the KV pool allocates per layer: nothing for a placeholder."""
    return [
        LayerKVShape(0, layer.kv_shape.head_dim, layer.kv_shape.v_head_dim)
        if isinstance(layer, StateLayerPlaceholder)
        else layer.kv_shape
        for layer in layers
    ]
