"""vLLM's spelling of sampling and engine settings, translated to nnrun's (for `nnrun.VLLM`).

nnsight's `VLLM` passes every trace/invoke keyword to `vllm.SamplingParams` and every constructor
keyword to `vllm.LLM`. These functions give each keyword vLLM's meaning on nnrun's engine, or
refuse it by name: a setting nnrun cannot honour must never be dropped silently.
"""

from __future__ import annotations

from typing import Any

from nnrun.sampling_params import MIN_TEMPERATURE, SamplingParams

# vLLM SamplingParams fields that nnrun.SamplingParams has under the same name and meaning.
SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
)

# vLLM fields nnrun takes only at the value that asks for nothing (an empty list counts as None),
# each with what a user loses if nnrun dropped another value.
SAMPLING_DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "n": (1, "several sampled sequences per prompt"),
    "best_of": (None, "best-of-n sampling"),
    "detokenize": (True, "skipping detokenization"),
    "spaces_between_special_tokens": (True, "custom special-token spacing"),
    "include_stop_str_in_output": (False, "keeping the stop string in the output"),
    "logits_processors": (None, "custom logits processors (edit `model.logits` in the trace instead)"),
    "truncate_prompt_tokens": (None, "prompt truncation"),
    "guided_decoding": (None, "guided decoding"),
    "structured_outputs": (None, "structured outputs"),
    "logit_bias": (None, "logit bias (edit `model.logits` in the trace instead)"),
    "allowed_token_ids": (None, "allowed token ids (edit `model.logits` in the trace instead)"),
    "bad_words": (None, "bad words"),
    "extra_args": (None, "extra_args"),
    "lora_request": (None, "LoRA adapters"),
    "edits": (None, "edits installed on the engine (`model.edit()` on vLLM)"),
}

# vLLM fields that change nothing a user can observe on nnrun: which outputs a stream yields
# (a trace waits for the finished request), and prefix-cache reads (nnrun recomputes every prompt).
SAMPLING_IGNORED = ("output_kind", "skip_reading_prefix_cache")

# nnsight's own trace keywords for running elsewhere: nnrun runs the engine in this process.
REMOTE_KEYWORDS = ("remote", "serve", "api_key", "backend")

ACCEPTED_SAMPLING = SAMPLING_FIELDS + tuple(SAMPLING_DEFAULT_ONLY) + SAMPLING_IGNORED + ("max_new_tokens",)


def vllm_sampling_kwargs(kwargs: dict) -> dict:
    """A copy of `kwargs` with `max_new_tokens` spelled `max_tokens`, as nnsight's VLLM rewrites it."""
    kwargs = dict(kwargs)
    if "max_new_tokens" in kwargs:
        if "max_tokens" in kwargs:
            raise TypeError("got both max_tokens and max_new_tokens; they are the same setting, pass one")
        kwargs["max_tokens"] = kwargs.pop("max_new_tokens")
    return kwargs


def check_sampling_kwargs(where: str, kwargs: dict) -> None:
    """Refuse, by name, a keyword that is not a vLLM sampling setting or that nnrun cannot honour."""
    for name, value in kwargs.items():
        if name in REMOTE_KEYWORDS:
            raise NotImplementedError(
                f"{where}({name}=...) runs the trace on a remote or served engine; nnrun.VLLM runs its engine in "
                f"this process, so drop {name}"
            )
        if name in SAMPLING_DEFAULT_ONLY:
            default, feature = SAMPLING_DEFAULT_ONLY[name]
            if not _is_default(value, default):
                raise NotImplementedError(
                    f"{where}({name}={value!r}): nnrun does not support {feature} yet; leave {name} at {default!r}"
                )
        elif name not in ACCEPTED_SAMPLING:
            raise TypeError(
                f"{where}() got unexpected keyword {name!r}: not a vLLM SamplingParams field. "
                f"Sampling keywords nnrun.VLLM accepts: {', '.join(SAMPLING_FIELDS)}"
            )


def vllm_sampling_params(kwargs: dict, where: str = "trace") -> SamplingParams:
    """vLLM's `SamplingParams(**kwargs)` as nnrun's: vLLM's defaults (16 tokens, temperature 1) included."""
    kwargs = vllm_sampling_kwargs(kwargs)
    check_sampling_kwargs(where, kwargs)
    values = {name: kwargs[name] for name in SAMPLING_FIELDS if name in kwargs}
    temperature = values.get("temperature")
    if isinstance(temperature, (int, float)) and 0.0 <= temperature < MIN_TEMPERATURE:
        values["temperature"] = 0.0  # vLLM: a temperature below its epsilon (1e-5) is greedy decoding
    return SamplingParams(**values)


def _is_default(value: Any, default: Any) -> bool:
    if default is None:
        return value is None or (isinstance(value, (list, tuple, dict, set)) and not value)
    return value == default and type(value) is type(default)


# ---- engine keywords --------------------------------------------------------------------------
# vLLM engine keywords that nnrun's engine takes under another name.
ENGINE_RENAMED = {"block_size": "page_size"}
# vLLM engine keywords nnrun takes only at the value that asks for one GPU, one process, no extras
# (`tensor_parallel_size` passes through: nnrun runs traces on tensor-parallel ranks too).
ENGINE_DEFAULT_ONLY: dict[str, tuple[tuple, str]] = {
    "pipeline_parallel_size": ((1,), "pipeline parallelism"),
    "data_parallel_size": ((1,), "data parallelism"),
    "distributed_executor_backend": ((None, "uni", "mp"), "a distributed executor (ray, external_launcher)"),
    "mode": (("sync",), "the async engine (mode='async', streaming through tracer.backend)"),
    "quantization": ((None,), "quantized weights"),
    "enable_lora": ((False, None), "LoRA adapters"),
    "speculative_config": ((None,), "speculative decoding"),
    "kv_cache_dtype": (("auto", None), "a KV cache in another dtype"),
    "cpu_offload_gb": ((0, None), "CPU weight offloading"),
    "tokenizer_mode": (("auto", None), "another tokenizer mode (pass tokenizer=<a loaded tokenizer>)"),
}
# Keywords that change nothing observable on nnrun: `dispatch` (the engine is always built), taps
# (every traced step runs eagerly, so every location is served), prefix caching and chunked prefill
# (nnrun recomputes every prompt and never splits one), and vLLM's own logging/capture/swap settings.
ENGINE_IGNORED = (
    "dispatch",
    "taps",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "disable_log_stats",
    "swap_space",
    "max_seq_len_to_capture",
    "disable_custom_all_reduce",
    "compilation_config",
)


def vllm_engine_kwargs(kwargs: dict) -> tuple[dict, int | None]:
    """vLLM's `LLM(**kwargs)` keywords as nnrun engine keywords, and the engine seed (None: not set).

    Keywords neither vLLM-only nor refused pass through: nnrun's own engine options (page_size,
    max_total_tokens, attention_backend, ...) work on `VLLM` as on `LanguageModel`.
    """
    out: dict[str, Any] = {}
    seed = None
    for name, value in kwargs.items():
        if name in ENGINE_DEFAULT_ONLY:
            allowed, feature = ENGINE_DEFAULT_ONLY[name]
            if not any(_is_default(value, option) for option in allowed):
                raise NotImplementedError(
                    f"VLLM({name}={value!r}): nnrun does not support {feature} yet "
                    f"(accepted: {', '.join(map(repr, allowed))})"
                )
        elif name in ENGINE_IGNORED:
            continue
        elif name == "seed":
            seed = value
        elif name == "enforce_eager":
            out["enable_cuda_graphs"] = not value  # traced steps always run eagerly; this covers untraced ones
        else:
            out[ENGINE_RENAMED.get(name, name)] = value
    return out, seed
