"""The keywords `nnrun.LanguageModel` takes where nnsight's LanguageModel does, with nnsight's meaning.

Three places take keywords:

- `trace`/`generate`/`invoke`: HF `generate` settings (`GENERATE_KWARGS`), and `generate`'s
  `streamer`. On HF a trace is one forward, which takes them and changes nothing, so a trace
  accepts and ignores them too.
- the constructor: nnsight passes loading keywords to `transformers.pipeline`/`from_pretrained`;
  `engine_kwargs` gives each the meaning it has on nnrun's engine (`torch_dtype` is `dtype`, a
  one-device `device_map` is `device`), accepts the ones that only choose what nnrun always does
  (`dispatch`), and refuses by name the ones nnrun cannot honour (several devices, quantization,
  adapters). Everything else is an engine option (`page_size`, `max_num_seqs`, ...).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

# HF `generate` settings the engine's sampling takes (see `LanguageModel._sampling_params`).
GENERATE_KWARGS = (
    "max_new_tokens",
    "max_length",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
)
# A local `generate(...)` also takes an HF streamer (`put`/`end`), fed from the caller's thread.
STREAMER_KWARGS = ("streamer",)
# A trace is one forward: HF's forward takes generation settings and ignores them, and so does nnrun.
TRACE_KWARGS = GENERATE_KWARGS + STREAMER_KWARGS
INVOKE_KWARGS = GENERATE_KWARGS


def _check_kwargs(where: str, kwargs: dict, allowed: Sequence[str]) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise TypeError(f"{where}() got unsupported keyword(s) {', '.join(unknown)}; nnrun accepts: {accepted}")


# nnsight's choices of where a trace runs: a local nnrun model runs it on its own engine.
_BACKENDS = {
    "remote": "remote=True runs traces on NDIF; nnrun runs them on its own engine (to share one engine, "
    "start `nnrun serve` and build the model with LanguageModel(name, serve=url))",
    "backend": "custom nnsight backends (a trace runs as requests on nnrun's engine)",
    "serve": "this model runs on its own engine; build it with LanguageModel(name, serve=url) to send traces to "
    "an `nnrun serve` engine",
    "blocking": "blocking=False belongs to remote models (LanguageModel(name, serve=url))",
    "api_key": "api_key belongs to remote models (LanguageModel(name, serve=url, api_key=...))",
}
_BACKEND_DEFAULTS = {"remote": False, "backend": None, "serve": None, "blocking": True, "api_key": None}


def refuse_backends(where: str, kwargs: dict) -> None:
    """Drop nnsight's where-to-run keywords at their defaults; refuse any other value by name."""
    for name, reason in _BACKENDS.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if value is not _BACKEND_DEFAULTS[name] and value != _BACKEND_DEFAULTS[name]:
                raise NotImplementedError(f"{where}({name}={value!r}) is not supported here: {reason}")


# ---- constructor ------------------------------------------------------------------------------
# nnsight keywords that choose what nnrun always does: accepted, with no effect.
_NO_OP = {
    "dispatch": "nnrun loads the weights when the model is built (nnsight's dispatch=True)",
    "meta_buffers": "nnrun builds no meta model",
    "low_cpu_mem_usage": "the weights are loaded once, on the engine's device",
    "attn_implementation": "attention runs on nnrun's paged kernels (values as HF's sdpa/eager, up to rounding)",
}
# nnsight keywords nnrun takes only at the value that asks for nothing nnrun lacks.
_DEFAULT_ONLY: dict[str, tuple[tuple, str]] = {
    "task": ((None, "text-generation"), "pipeline tasks other than text generation"),
    "peft": ((None,), "PEFT adapters (merge the adapter into the model and pass that)"),
    "processor": ((None,), "multimodal processors"),
    "image_processor": ((None,), "image inputs"),
    "feature_extractor": ((None,), "audio inputs"),
    "quantization_config": ((None,), "quantized weights"),
    "max_memory": ((None,), "placing the model across devices"),
    "tp_plan": ((None,), "tensor parallelism"),
    "distributed_config": ((None,), "tensor parallelism"),
    "use_fast": ((None, True), "slow tokenizers (pass tokenizer=AutoTokenizer.from_pretrained(..., use_fast=False))"),
    "token": ((None,), "a hub token argument (set HF_TOKEN or run `hf auth login`)"),
    "model_kwargs": ((None,), "extra from_pretrained keywords (load the model with transformers and pass it)"),
    "envoys": ((None,), "custom envoy classes"),
    "interleaver": ((None,), "a custom interleaver (the engine owns it)"),
}
_AUTOMODEL = "AutoModelForCausalLM"
_DEVICE_MAP_PLACEMENTS = ("auto", "balanced", "balanced_low_0", "sequential")


def engine_kwargs(model: Any, device: Any, dtype: Any, kwargs: dict) -> tuple[Any, Any, dict, dict]:
    """nnsight's LanguageModel keywords as `LLM(...)`'s: `(device, dtype, engine options, tokenizer settings)`.

    Keywords nnsight does not know pass through as engine options (validated by the engine).
    """
    kwargs = dict(kwargs)
    for name in _NO_OP:
        kwargs.pop(name, None)
    for name, (allowed, feature) in _DEFAULT_ONLY.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if not any(value is option or (option is not None and value == option) for option in allowed):
                raise NotImplementedError(f"LanguageModel({name}={value!r:.60}): nnrun does not support {feature}")
    _check_automodel(kwargs.pop("automodel", None))
    _check_config(model, kwargs.pop("config", None))
    if "torch_dtype" in kwargs:
        dtype = _one_of("dtype", dtype, "torch_dtype", kwargs.pop("torch_dtype"))
    if "device_map" in kwargs:
        device = (
            _one_of(
                "device", None if device == "cpu" else device, "device_map", _device_of_map(kwargs.pop("device_map"))
            )
            or device
        )
    tokenizer_settings = kwargs.pop("tokenizer_kwargs", None) or {}
    if not isinstance(tokenizer_settings, dict):
        raise TypeError(
            f"tokenizer_kwargs must be a dict of tokenizer attributes, got {type(tokenizer_settings).__name__}"
        )
    return device, dtype, kwargs, tokenizer_settings


def apply_tokenizer_settings(tokenizer: Any, settings: dict) -> None:
    """`tokenizer_kwargs`, as nnsight applies them: each one set as an attribute of the loaded tokenizer."""
    if not settings:
        return
    if tokenizer is None:
        raise ValueError(f"tokenizer_kwargs={settings!r} given, but the model has no tokenizer; pass tokenizer=...")
    for name, value in settings.items():
        setattr(tokenizer, name, value)


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """A setting given under two names: they must agree."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(f"got {name}={value!r} and {alias}={alias_value!r}; they are the same setting, pass one")
    return alias_value if alias_value is not None else value


def _device_of_map(device_map: Any) -> str | None:
    """A `device_map` that puts the whole model on one device, as that device; any other is refused."""
    if device_map is None:
        return None
    if isinstance(device_map, dict):
        devices = {_device_name(device) for device in device_map.values()}
        if len(devices) == 1:
            return devices.pop()
    elif not (isinstance(device_map, str) and device_map in _DEVICE_MAP_PLACEMENTS):
        return _device_name(device_map)
    raise NotImplementedError(
        f"LanguageModel(device_map={device_map!r:.60}): nnrun runs a model on one device and does not place it "
        "across devices; pass device='cuda:0' (or device_map='cuda:0')"
    )


def _device_name(device: Any) -> str:
    if isinstance(device, bool):
        raise ValueError(f"device_map must name a device, got {device!r}")
    if isinstance(device, int):
        return f"cuda:{device}"
    return str(torch.device(device))


def _check_automodel(automodel: Any) -> None:
    """nnrun loads causal LMs through `AutoModelForCausalLM`; nnsight let the auto class be chosen."""
    if automodel is None:
        return
    name = automodel if isinstance(automodel, str) else getattr(automodel, "__name__", repr(automodel))
    if name != _AUTOMODEL:
        raise NotImplementedError(
            f"LanguageModel(automodel={name}): nnrun loads models with {_AUTOMODEL} only; "
            "load the model yourself and pass it"
        )


def _check_config(model: Any, config: Any) -> None:
    """`config=` replaces a checkpoint's config at load: nnrun loads with the checkpoint's own."""
    if config is None or config is getattr(model, "config", None):
        return
    raise NotImplementedError(
        "LanguageModel(config=...): nnrun loads a checkpoint with its own config; build the model with "
        "AutoModelForCausalLM.from_pretrained(path, config=config) and pass it, or pass the config with "
        "load_format='dummy' for random weights"
    )
