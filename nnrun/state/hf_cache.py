"""HF's own cache objects over pool rows: what a mixer layer reads and updates, for one group of requests.

A mixer (HF's `MambaMixer`, `Qwen3NextGatedDeltaNet`, `Lfm2ShortConv`, ...) talks to its cache
only through `get_conv_state` / `update_conv_state` / `get_recurrent_state` /
`update_recurrent_state` / `is_recording_past` on `cache.layers[layer_idx]`, a
`LinearAttentionLayer`. We hand it exactly that: HF's own layer class, filled with the gathered
rows' states when the requests continue, empty (HF's fresh-prefill path) when they start. HF's
code then pads, concatenates and updates the states as it does for one prompt alone; afterwards
the layer's tensors are what the pool stores for those rows.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

from nnrun.state.pool import StateKey, StatePool

_PLACEHOLDER = DummyLayer()  # the other layers' slots in `cache.layers`; the mixer never touches them


def rows_cache(
    pool: StatePool, layer_idx: int, num_states: int, rows: torch.Tensor, continues: bool
) -> tuple[Cache, LinearAttentionLayer]:
    """An HF cache whose layer `layer_idx` holds these rows' states (`continues`) or nothing yet (a fresh prefill)."""
    layer = LinearAttentionLayer(number_of_states=num_states)
    if continues:
        for state_idx in range(num_states):
            conv = pool.read((layer_idx, "conv", state_idx), rows)  # [B, channels, kernel]
            if conv is not None:
                layer.conv_states[state_idx] = conv
                layer.conv_kernel_size[state_idx] = conv.shape[-1]
                layer.is_conv_states_initialized[state_idx] = True
                layer.dtype, layer.device = conv.dtype, conv.device
            recurrent = pool.read((layer_idx, "recurrent", state_idx), rows)  # [B, *HF's state shape]
            if recurrent is not None:
                layer.recurrent_states[state_idx] = recurrent
                layer.is_recurrent_states_initialized[state_idx] = True
            layer.has_previous_state[state_idx] = conv is not None or recurrent is not None
    return Cache(layers=[_PLACEHOLDER] * layer_idx + [layer]), layer


def written_states(layer_idx: int, layer: LinearAttentionLayer) -> list[tuple[StateKey, torch.Tensor]]:
    """The states HF's code left in `layer` after the mixer ran, keyed for the pool."""
    states = []
    for state_idx in range(layer.number_of_states):
        if layer.is_conv_states_initialized[state_idx]:
            states.append(((layer_idx, "conv", state_idx), layer.conv_states[state_idx]))
        if layer.is_recurrent_states_initialized[state_idx]:
            states.append(((layer_idx, "recurrent", state_idx), layer.recurrent_states[state_idx]))
    return states
