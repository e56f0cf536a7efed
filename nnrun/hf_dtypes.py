"""Dtypes as HF's own loading leaves them: the one place where nnrun changes a model's dtype.

`model.to(dtype=torch.bfloat16)` casts every floating tensor. HF's `from_pretrained(dtype=...)`
does not: it builds the model under that default dtype, so what a module builds explicitly in
float32 stays float32 (RoPE's `inv_freq` and `original_inv_freq`, router biases some families
build in fp32), and it loads what `_keep_in_fp32_modules` (fp16 only) and
`_keep_in_fp32_modules_strict` (fp16 and bf16) name in float32. A bf16 `inv_freq` rounds RoPE's
frequencies, and the rotation angle's error grows with the position (54% off fp32 at 2048 tokens
on a 2-layer Llama, against HF's 2.5%).

`hf_dtypes` asks HF itself: it builds the model's class on the meta device under HF's own init
context for that dtype (what `from_pretrained` builds before reading weights) and applies the
class's own keep-in-fp32 plan to what a checkpoint holds (parameters, persistent buffers).
"""

from __future__ import annotations

import copy
import warnings

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.core_model_loading import build_glob_alternation
from transformers.utils.generic import ContextManagers


def hf_dtypes(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Per floating parameter and buffer of `model` that its class builds: the dtype `from_pretrained(dtype=dtype)` gives it.

    A tensor the class does not build (a module added after loading) has no HF rule and is not named.
    """
    model_class = type(model)
    contexts = model_class.get_init_context(dtype, False, False, None)  # meta device, `dtype` as default
    with warnings.catch_warnings(), ContextManagers(contexts):
        warnings.simplefilter("ignore")
        skeleton = model_class(_name_dtype(copy.deepcopy(model.config), dtype))
    built = {name: t.dtype for name, t in _tensors(skeleton) if t.is_floating_point()}
    plan = skeleton._get_dtype_plan(dtype)  # keep-in-fp32 globs, matched against checkpoint keys as HF does
    pattern, group_to_glob, _ = build_glob_alternation(list(plan)) if plan else (None, {}, {})
    in_checkpoint = set(skeleton.state_dict())
    dtypes = {}
    for name, tensor in _tensors(model):
        if not tensor.is_floating_point() or name not in built:
            continue
        match = pattern.search(name) if pattern is not None and name in in_checkpoint else None
        dtypes[name] = plan[group_to_glob[match.lastgroup]] if match else built[name]
    return dtypes


def dtype_departures(model: PreTrainedModel, dtype: torch.dtype) -> list[str]:
    """`name: has X, HF gives Y` for each tensor whose dtype is not HF's at `dtype` (empty: as HF loads it)."""
    tensors = dict(_tensors(model))
    return [
        f"{name}: {_short(tensors[name].dtype)}, HF's loading gives {_short(expected)}"
        for name, expected in hf_dtypes(model, dtype).items()
        if tensors[name].dtype != expected
    ]


def cast_like_hf(model: PreTrainedModel, dtype: torch.dtype, in_place: bool = False) -> PreTrainedModel:
    """`model` with every tensor in the dtype HF's loading at `dtype` gives it, values cast from `model`'s.

    `in_place=False` leaves `model` as it was and returns a copy (the cast tensors are built once,
    without first copying the originals); `in_place=True` changes `model` itself (a model nnrun built).
    """
    tensors = dict(_tensors(model))
    rules = hf_dtypes(model, dtype)  # a tensor the class does not build is cast to `dtype`, as `.to(dtype)` would
    targets = {name: rules.get(name, dtype) for name, tensor in tensors.items() if tensor.is_floating_point()}
    if in_place:
        for name, target in targets.items():
            if tensors[name].dtype != target:
                tensors[name].data = tensors[name].data.to(target)
    else:
        memo = {}  # deepcopy takes each tensor from here: the cast one, never a full-size copy of the original
        for name, target in targets.items():
            tensor = tensors[name]
            cast = tensor.detach().to(target, copy=True)
            memo[id(tensor)] = torch.nn.Parameter(cast, tensor.requires_grad) if _is_parameter(tensor) else cast
        model = copy.deepcopy(model, memo)
    _name_dtype(model.config, dtype)
    return model


def _name_dtype(config: PretrainedConfig, dtype: torch.dtype) -> PretrainedConfig:
    """`config` and its sub-configs naming `dtype`, as HF's loading sets them (composites build their parts by it)."""
    config.dtype = dtype
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            sub.dtype = dtype
    return config


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return [(name, tensor) for name, tensor in named if tensor is not None]


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.nn.Parameter)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
