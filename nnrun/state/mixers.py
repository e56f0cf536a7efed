"""Mixer layers (state-space, linear-attention, short-conv) run per request inside a packed forward.

A pass over the built model, like `nnrun/position_adapters.py`: every module whose HF forward
keeps a recurrent state gets an instance `forward` that, inside a packed step, splits the flat
`[1, N, H]` input into each request's tokens and runs HF's own forward on each with that
request's state from the pool (`StateStep.run_mixer`). Those are the modules that keep it in
HF's cache (they call `update_conv_state` / `update_recurrent_state`, as Mamba's, Mamba2's,
Jamba's, Bamba's, Qwen3-Next's `GatedDeltaNet`, LFM2's short conv and the other 5.23 mixers do,
or `set_linear_cache`, MiniMax's lightning attention's own cache API), and the few that keep it
their own way (`bridges.OWN_WAYS`: RecurrentGemma, RWKV, xLSTM). Outside a step (a plain call,
the load-time probes, the exact path) it is HF's forward unchanged. No hooks, and the module and
its path stay HF's, so nnsight sees `...mixer` output `[1, N, H]` and slices each invoke's tokens.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch

from nnrun.attention.context import current_state_step
from nnrun.inner_modules import inner_modules_unseen
from nnrun.state.bridges import OWN_WAYS, Bridge, HFCache

_ADAPTED = "_nnrun_state_mixer"  # MixerInfo on an adapted module: the pass runs once per model object
CACHE_ARGUMENTS = ("cache_params", "past_key_values")  # the name a mixer's forward takes HF's cache by
# Mixers whose HF forward returns several values per token (Zaya's CCA projection: query, key and value)
NUM_TOKEN_OUTPUTS = {"ZayaCCAProjection": 3}
# HF's cache API for recurrent state, and MiniMax's own (its `MiniMaxCache` keeps one K^T V state per layer)
STATE_CALLS = ("update_conv_state", "update_recurrent_state", "set_linear_cache")


@dataclass(frozen=True)
class MixerInfo:
    """One mixer layer: its `layer_idx`, how its state reaches HF's code, and how many states of each kind it keeps."""

    layer_idx: int
    bridge: Bridge
    num_states: int
    num_token_outputs: int = 1  # how many of HF's outputs are laid out per token (the first, or Zaya's q, k, v)


def mixer_info(name: str, module: torch.nn.Module, num_states: int) -> MixerInfo | None:
    """The module's MixerInfo if its HF forward keeps a recurrent state (`name`: its path in the model); else None."""
    own_way = OWN_WAYS.get(type(module).__name__)
    if own_way is not None:  # HF gives these no layer_idx: their index in the model's list of layers
        layer_idx = next((int(part) for part in reversed(name.split(".")) if part.isdigit()), None)
        if layer_idx is None:
            raise ValueError(
                f"{type(module).__name__} at {name!r} is not in a list of layers: its layer index is unknown"
            )
        return MixerInfo(layer_idx, own_way, own_way.num_states)
    layer_idx = getattr(module, "layer_idx", None)
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if not isinstance(layer_idx, int) or code is None or not set(STATE_CALLS) & set(code.co_names):
        return None
    parameters = inspect.signature(forward).parameters
    cache_argument = next((name for name in CACHE_ARGUMENTS if name in parameters), None)
    if cache_argument is None:
        return None
    return MixerInfo(layer_idx, HFCache(cache_argument), num_states, NUM_TOKEN_OUTPUTS.get(type(module).__name__, 1))


def adapt_mixers(model: torch.nn.Module) -> list[MixerInfo]:
    """Adapt every mixer layer of `model` (idempotent); returns them by `layer_idx`."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    num_states = getattr(config, "number_of_conv_states", 1) or 1
    mixers = []
    for name, module in model.named_modules():
        info = getattr(module, _ADAPTED, None) or mixer_info(name, module, num_states)
        if info is None:
            continue
        if getattr(module, _ADAPTED, None) is None:
            # A method bound to the module (not a closure over it): a deep copy of the model rebinds it to the copy.
            module.forward = types.MethodType(_mixer_forward, module)
            setattr(module, _ADAPTED, info)
        mixers.append(info)
    return sorted(mixers, key=lambda info: info.layer_idx)


def _mixer_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """HF's own forward; inside a packed step, once per request (or per decode batch) with its state."""
    hf_forward = type(self).forward
    step = current_state_step()
    # Outside a step, or a second call in one (intervention code calling the module itself): HF's own
    # forward on what it was given, with the cache it was given (none), as HF alone would run that call.
    if step is None or not step.is_first_call(self):
        return hf_forward(self, hidden_states, *args, **kwargs)
    info: MixerInfo = getattr(self, _ADAPTED)
    if args:  # Zaya's attention passes its CCA projection's cache and mask by position
        kwargs = _by_name(self, args, kwargs)
    kwargs.pop(info.bridge.argument, None)  # None in a packed step (no cache); the state is the pool's
    num_returned = []  # how many values HF's forward returns, if a tuple (MiniMax's: output and new state)

    def call(hidden: torch.Tensor, cache, call_kwargs: dict) -> tuple[torch.Tensor, ...]:
        output = info.bridge.call(self, hf_forward, info.layer_idx, hidden, cache, call_kwargs)
        if not isinstance(output, tuple):
            return (output,)
        num_returned[:] = [len(output)]
        return output[: info.num_token_outputs]

    with inner_modules_unseen(self, "mixer", info.layer_idx, "once per request"):
        outputs = step.run_mixer(info.layer_idx, info.num_states, hidden_states, kwargs, call)
    if not num_returned:
        return outputs[0]
    # The values after the per-token ones (MiniMax's new state) are each request's own, not laid out as the
    # step's tokens: none here.
    return (*outputs, *[None] * (num_returned[0] - len(outputs)))


def _by_name(mixer: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """The arguments after hidden_states, all by name, as the mixer's HF forward names them."""
    parameters = list(inspect.signature(type(mixer).forward).parameters.values())[2:]  # after self, hidden_states
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(names):
        raise TypeError(f"{type(mixer).__name__} was called with {len(args)} positional arguments after hidden_states")
    return {**dict(zip(names, args)), **kwargs}


def adapted_mixer_layer_ids(model: torch.nn.Module) -> frozenset[int]:
    """The `layer_idx` of every mixer `adapt_mixers` adapted in `model` (none if it never ran)."""
    return frozenset(info.layer_idx for module in model.modules() if (info := getattr(module, _ADAPTED, None)))
