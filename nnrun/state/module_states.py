"""Mixers that keep their recurrent state on the module itself, not in HF's cache (RecurrentGemma's recurrent block).

HF's RecurrentGemma keeps each recurrent block's conv and RG-LRU states as attributes of the block
(`conv1d_state`, `rg_lru.recurrent_states`), for whatever batch it ran last. On the packed path
such a block runs per request (or per decode batch) like any mixer: its attributes are set to
those rows' states from the pool (None for a fresh prefill, where HF starts from zeros), HF's
forward runs with `use_cache=True` so that it carries them on, and afterwards they go to the pool
and the attributes get back what they held before.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nnrun.state.hf_cache import RowsCache

# class name -> (state kind, the attribute path it lives at on the module)
MODULE_STATES: dict[str, tuple[tuple[str, str], ...]] = {
    "RecurrentGemmaRecurrentBlock": (("conv", "conv1d_state"), ("recurrent", "rg_lru.recurrent_states")),
}


def module_states_of(module: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    """The (kind, attribute path) of each state the module keeps on itself; empty for any other module."""
    return MODULE_STATES.get(type(module).__name__, ())


def call_with_module_states(
    module: torch.nn.Module,
    hf_forward: Callable[..., Any],
    states: tuple[tuple[str, str], ...],
    layer_idx: int,
    hidden_states: torch.Tensor,
    cache: RowsCache,
    kwargs: dict[str, Any],
) -> Any:
    """HF's forward on the rows whose states `cache` holds; their new states are left in `cache`."""
    held = {path: _get(module, path) for _, path in states}
    try:
        for kind, path in states:
            _set(module, path, cache.read_state(kind, layer_idx))
        output = hf_forward(module, hidden_states, **{**kwargs, "use_cache": True})
        for kind, path in states:
            cache.keep_state(kind, layer_idx, _get(module, path))
    finally:
        for path, value in held.items():
            _set(module, path, value)
    return output


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
