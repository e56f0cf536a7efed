"""How a mixer's HF forward is handed its state and gives it back, family by family.

Most 5.23 mixers take HF's cache (`HFCache`): a `RowsCache` over the rows' states goes in under
the argument their forward names. A few keep their state elsewhere, and get it there:

- RecurrentGemma's recurrent block keeps it as attributes of itself (`ModuleAttributes`);
- RWKV's blocks take the whole model's state, five `[B, hidden, num_layers]` tensors, and read
  and write their own layer's column (`RwkvColumns`);
- xLSTM's blocks take their layer's `(C, n, m)` and return the new one (`XlstmState`).

Each bridge puts the rows' states (from the `RowsCache`; None for a fresh prefill, where HF's
code starts from its own initial state, xLSTM's from its cache's) where HF's code reads them,
calls HF's forward, and leaves the new states in the `RowsCache` for the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from nnrun.state.hf_cache import RowsCache

HFForwardFn = Callable[..., Any]  # the mixer class's own forward, called with the module first


@dataclass(frozen=True)
class HFCache:
    """HF's cache API (`get_conv_state`, `update_recurrent_state`, ...): the cache goes in as `argument`."""

    argument: str  # "cache_params" or "past_key_values"

    def call(self, module, hf_forward: HFForwardFn, layer_idx: int, hidden, cache: RowsCache, kwargs: dict) -> Any:
        return hf_forward(module, hidden, **{self.argument: cache}, **kwargs)


@dataclass(frozen=True)
class ModuleAttributes:
    """States kept as attributes of the module: set to the rows' for the call, the module's own given back after."""

    paths: tuple[tuple[str, str], ...]  # (state kind, attribute path on the module)
    argument: None = None
    num_states: int = 1

    def call(self, module, hf_forward: HFForwardFn, layer_idx: int, hidden, cache: RowsCache, kwargs: dict) -> Any:
        held = {path: _get(module, path) for _, path in self.paths}
        try:
            for kind, path in self.paths:
                _set(module, path, cache.read_state(kind, layer_idx))
            output = hf_forward(module, hidden, **{**kwargs, "use_cache": True})  # HF carries them on only then
            for kind, path in self.paths:
                cache.keep_state(kind, layer_idx, _get(module, path))
        finally:
            for path, value in held.items():
                _set(module, path, value)
        return output


@dataclass(frozen=True)
class RwkvColumns:
    """RWKV: the block reads and writes column `layer_id` of five `[B, hidden, num_layers]` state tensors.

    HF's single-token path mixes a `[B, 1, hidden]` input with a `[B, hidden]` state column, which
    broadcasts to `[B, B, hidden]` for more than one request: a decode batch runs one request at a time.
    """

    argument: str = "state"
    num_states: int = 5

    def call(self, module, hf_forward: HFForwardFn, layer_idx: int, hidden, cache: RowsCache, kwargs: dict) -> Any:
        columns = [cache.read_state("recurrent", layer_idx, i) for i in range(self.num_states)]  # each [B, hidden]
        if columns[0] is None:  # a fresh prefill: HF's initial state, as RwkvModel.forward builds it
            columns = [
                torch.zeros(hidden.shape[0], hidden.shape[-1], dtype=dtype, device=hidden.device)
                for dtype in (hidden.dtype, hidden.dtype, torch.float32, torch.float32, torch.float32)
            ]
            columns[4] -= 1e30
        outputs = []
        for row in range(hidden.shape[0]):
            # A view whose every column is this row's (stride 0 over the layer axis): the block writes its new
            # state into `columns` itself.
            state = [column[row : row + 1, :, None].expand(1, column.shape[1], layer_idx + 1) for column in columns]
            outputs.append(hf_forward(module, hidden[row : row + 1], state=state, **{**kwargs, "use_cache": True}))
        for i, column in enumerate(columns):
            cache.keep_state("recurrent", layer_idx, column, i)
        return (torch.cat([output[0] for output in outputs]), *outputs[0][1:])  # (hidden [B, T, H], state, ...)


@dataclass(frozen=True)
class XlstmState:
    """xLSTM: the block takes its layer's `(C, n, m)` and returns the new one after its output.

    A fresh prefill starts from zeros in the model's dtype, as HF's model forward with its cache (`xLSTMCache`,
    which `generate` uses) hands them: with no state the block would start from float32 zeros, which HF's own
    chunkwise kernel cannot mix with half-precision keys.
    """

    argument: str = "state"
    num_states: int = 3

    def call(self, module, hf_forward: HFForwardFn, layer_idx: int, hidden, cache: RowsCache, kwargs: dict) -> Any:
        states = [cache.read_state("recurrent", layer_idx, i) for i in range(self.num_states)]
        if states[0] is None:
            states = _xlstm_zero_states(module.config, hidden.shape[0], hidden.dtype, hidden.device)
        output = hf_forward(module, hidden, state=tuple(states), **kwargs)
        for i, value in enumerate(output[1]):
            cache.keep_state("recurrent", layer_idx, value, i)
        return output


def _xlstm_zero_states(config, num_rows: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """A layer's `(C, n, m)` as HF's `xLSTMCache` starts them: zeros `[B, nh, dqk, dv]`, `[B, nh, dqk]`, `[B, nh, 1]`"""
    heads, dqk = config.num_heads, config.qk_head_dim
    shapes = ((num_rows, heads, dqk, config.v_head_dim), (num_rows, heads, dqk), (num_rows, heads, 1))
    return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]


Bridge = HFCache | ModuleAttributes | RwkvColumns | XlstmState

# Mixer classes that keep their state their own way (HF gives none of them a `layer_idx`)
OWN_WAYS: dict[str, Bridge] = {
    "RecurrentGemmaRecurrentBlock": ModuleAttributes(
        (("conv", "conv1d_state"), ("recurrent", "rg_lru.recurrent_states"))
    ),
    "RwkvBlock": RwkvColumns(),
    "xLSTMBlock": XlstmState(),
}


def _get(module: torch.nn.Module, path: str) -> Any:
    owner, name = _owner(module, path)
    return getattr(owner, name)


def _set(module: torch.nn.Module, path: str, value: Any) -> None:
    owner, name = _owner(module, path)
    setattr(owner, name, value)


def _owner(module: torch.nn.Module, path: str) -> tuple[Any, str]:
    *parents, name = path.split(".")
    for parent in parents:
        module = getattr(module, parent)
    return module, name
