"""HF's own cache objects over pool rows: what a mixer layer reads and updates, for one group of requests.

A mixer (HF's `MambaMixer`, `Qwen3NextGatedDeltaNet`, `Lfm2ShortConv`, ...) talks to its cache
only through `get_conv_state` / `update_conv_state` / `get_recurrent_state` /
`update_recurrent_state` / `is_recording_past` on `cache.layers[layer_idx]`, a
`LinearAttentionLayer`. We hand it exactly that: HF's own layer class, filled with the gathered
rows' states when the requests continue, empty (HF's fresh-prefill path) when they start. HF's
code then pads, concatenates and updates the states as it does for one prompt alone; afterwards
the layer's tensors are what the pool stores for those rows (those the mixer used: `RowsCache`
notes them).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

from nnrun.state.pool import StateKey, StatePool

_PLACEHOLDER = DummyLayer()  # the other layers' slots in `cache.layers`; the mixer never touches them


class RowsCache(Cache):
    """HF's `Cache` over one layer's states, noting which states the mixer used (only those are written back).

    Several modules of one layer may keep states of their own under one `layer_idx` (a state index
    each, as Inkling's short convolutions do); a module writes back only the states it read or updated.
    """

    def __init__(self, layer_idx: int, layer: LinearAttentionLayer) -> None:
        super().__init__(layers=[_PLACEHOLDER] * layer_idx + [layer])
        self.used: set[tuple[str, int]] = set()  # (kind, state_idx)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self.used.add(("conv", state_idx))  # a decode updates the returned tensor in place
        return super().get_conv_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.used.add(("conv", state_idx))
        return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self.used.add(("recurrent", state_idx))
        return super().get_recurrent_state(layer_idx, state_idx)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.used.add(("recurrent", state_idx))
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    # A mixer that keeps its state its own way (nnrun/state/bridges.py) reads and leaves it here
    def read_state(self, kind: str, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if kind == "conv":
            return self.get_conv_state(layer_idx, state_idx)
        return self.get_recurrent_state(layer_idx, state_idx)

    def keep_state(self, kind: str, layer_idx: int, value: torch.Tensor, state_idx: int = 0) -> None:
        layer = self.layers[layer_idx]
        if kind == "conv":
            layer.conv_states[state_idx], layer.is_conv_states_initialized[state_idx] = value, True
        else:
            layer.recurrent_states[state_idx], layer.is_recurrent_states_initialized[state_idx] = value, True
        self.used.add((kind, state_idx))

    # MiniMax's lightning attention keeps its K^T V state through `MiniMaxCache`'s API: the recurrent state here
    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.update_recurrent_state(linear_cache, layer_idx)


def rows_cache(
    pool: StatePool, layer_idx: int, num_states: int, rows: torch.Tensor, continues: bool
) -> tuple[RowsCache, LinearAttentionLayer]:
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
    return RowsCache(layer_idx, layer), layer


def written_states(
    layer_idx: int, cache: RowsCache, layer: LinearAttentionLayer
) -> list[tuple[StateKey, torch.Tensor]]:
    """The states the mixer used, as HF's code left them in `layer`, keyed for the pool."""
    states = []
    for kind, state_idx in sorted(cache.used):
        if kind == "conv" and layer.is_conv_states_initialized[state_idx]:
            states.append(((layer_idx, "conv", state_idx), layer.conv_states[state_idx]))
        if kind == "recurrent" and layer.is_recurrent_states_initialized[state_idx]:
            states.append(((layer_idx, "recurrent", state_idx), layer.recurrent_states[state_idx]))
    return states
