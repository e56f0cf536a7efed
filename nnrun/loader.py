"""Loading: an in-memory model, a checkpoint folder, a hub id, a bundled name, or dummy weights."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from nnrun.config import DeviceConfig, ModelConfig
from nnrun.exact.path import family_of
from nnrun.hf_dtypes import cast_like_hf
from nnrun.unservable import causal_lm_class, refuse_unservable, refusing_missing_libraries

UNSAFE_ROPE_TYPES = ("dynamic", "longrope")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Any  # a HF tokenizer, or None (then prompts must be token ids)
    name: str  # what the user gave, for manifests and messages


def load_model(model_config: ModelConfig, device_config: DeviceConfig) -> LoadedModel:
    """Build the HF model in the configured dtype as HF's own loading leaves it, on the configured device, in eval mode.

    Only the device changes after loading: a checkpoint loads through `from_pretrained(dtype=...)`,
    dummy weights are built as HF builds that dtype, and an in-memory model keeps its dtypes unless
    another dtype is asked for, when nnrun serves a copy cast as HF's loading would (`cast_like_hf`).
    """
    source = model_config.model
    if isinstance(source, PreTrainedModel):
        refuse_unservable(type(source), family_of(source), source.config)
        name, path = type(source).__name__, getattr(source, "name_or_path", None) or None
        model = _in_memory(source, device_config)
    elif model_config.load_format == "dummy":
        model, name, path = _build_dummy(source, model_config, device_config.torch_dtype)
    else:
        name, path = str(source), _resolve_path(str(source))
        model = _from_pretrained(path, model_config, device_config.torch_dtype)
    model = model.to(device=device_config.device).eval()
    tokenizer = _load_tokenizer(model_config.tokenizer, path, model_config)
    return LoadedModel(model, tokenizer, name)


def _in_memory(model: PreTrainedModel, device_config: DeviceConfig) -> PreTrainedModel:
    """The user's model itself (dtype None, or its own), else a copy in the asked dtype as HF would load it.

    A copy, so that the user's object (often their fp32 oracle) never changes dtype behind their back.
    """
    if device_config.dtype is None or device_config.torch_dtype == model.dtype:
        device_config.torch_dtype = model.dtype
        return model
    return cast_like_hf(model, device_config.torch_dtype)


def _resolve_path(source: str) -> str:
    if os.path.isdir(source):
        return source
    from nnrun.assets import bundled_model_path, is_bundled_model

    if is_bundled_model(source):
        return str(bundled_model_path(source))
    return source  # a hub id: from_pretrained finds it in the local cache or downloads it


def _from_pretrained(path: str, model_config: ModelConfig, dtype: torch.dtype) -> PreTrainedModel:
    try:
        config = AutoConfig.from_pretrained(
            path, revision=model_config.revision, trust_remote_code=model_config.trust_remote_code
        )
        _refuse_before_building(config)
        with refusing_missing_libraries(config):
            return AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, revision=model_config.revision, trust_remote_code=model_config.trust_remote_code
            )
    except OSError as error:
        raise ValueError(
            f"could not load model {path!r}: it is not a local checkpoint folder, not a bundled model "
            f"(tiny-facts, tiny-facts-gpt2), and the HF hub did not provide it (not in the local cache, "
            f"or no network): {error}"
        ) from error


def _build_dummy(source: Any, model_config: ModelConfig, dtype: torch.dtype) -> tuple[PreTrainedModel, str, str | None]:
    """Random weights in the real shapes: for benchmarks of real architectures without downloads."""
    if isinstance(source, PretrainedConfig):
        # A copy: the engine sets its attention implementation on the model's config, which must
        # not leak into the caller's config object (and models they build from it later).
        config, name, path = copy.deepcopy(source), f"dummy-{source.model_type}", None
    else:
        path = _resolve_path(str(source))
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
        except OSError as error:
            raise ValueError(
                f"load_format='dummy' needs a config: could not load one for {source!r}: {error}"
            ) from error
        name = str(source)
    _refuse_before_building(config)
    torch.manual_seed(0)
    with refusing_missing_libraries(config):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=model_config.trust_remote_code)
    # from_config builds in `dtype` (what a module builds in fp32 stays fp32) but skips the keep-in-fp32 plan
    return cast_like_hf(model, dtype, in_place=True), name, path


def _refuse_before_building(config: PretrainedConfig) -> None:
    """A family nnrun cannot serve is refused from its config, before its weights are built or read."""
    model_class = causal_lm_class(config)
    if model_class is not None:
        refuse_unservable(model_class, config.model_type, config)


def _load_tokenizer(tokenizer: Any, path: str | None, model_config: ModelConfig) -> Any:
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    source = tokenizer if isinstance(tokenizer, str) else path
    if source is None:
        return None
    source = _resolve_path(source)
    try:
        return AutoTokenizer.from_pretrained(
            source, revision=model_config.revision, trust_remote_code=model_config.trust_remote_code
        )
    except (OSError, ValueError, ImportError, TypeError):  # no tokenizer files, or its library is not installed
        if tokenizer is not None:
            raise ValueError(f"could not load tokenizer {tokenizer!r}") from None
        return None  # a checkpoint without tokenizer files: token-id prompts still work


def packed_unfit_reason(config: PretrainedConfig) -> str | None:
    """Why a config's numbers for one request would depend on the others in a packed batch (None: no known reason)."""
    for rope in _rope_settings(config):
        rope_type = rope.get("rope_type") or rope.get("type")
        if rope_type in UNSAFE_ROPE_TYPES:
            return (
                f"rope_type={rope_type!r}: its RoPE frequencies depend on the longest position in the whole "
                "batch, so packed requests would change each other's results"
            )
    return None


def check_model_supported(config: PretrainedConfig) -> None:
    """Refuse configs the packed path cannot serve where there is no exact path to fall back on (tensor parallel)."""
    reason = packed_unfit_reason(config)
    if reason is not None:
        raise ValueError(
            f"model config has {reason}; nnrun refuses such models here (use a static RoPE scaling: "
            "default, linear, llama3 or yarn)"
        )


def _rope_settings(config: PretrainedConfig) -> list[dict]:
    found: list[dict] = []
    configs = [config] + [getattr(config, key) for key in ("text_config",) if getattr(config, key, None) is not None]
    for cfg in configs:
        for attr in ("rope_scaling", "rope_parameters"):
            value = getattr(cfg, attr, None)
            if isinstance(value, dict):
                nested = [v for v in value.values() if isinstance(v, dict)]
                found.extend(nested or [value])
    return found


def max_context_len(config: PretrainedConfig) -> int:
    """The longest sequence the model's positions support."""
    for cfg in (config, getattr(config, "text_config", None)):
        for attr in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
            value = getattr(cfg, attr, None) if cfg is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return 2048


__all__ = ["LoadedModel", "check_model_supported", "load_model", "max_context_len", "packed_unfit_reason"]
