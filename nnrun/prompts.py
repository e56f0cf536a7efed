"""Turn a user's prompt into validated token ids, for `LLM.generate` and `LanguageModel` traces alike.

A prompt is a string, or one sequence of token ids: a list/tuple of integral scalars (Python
ints, numpy integers, 0-d integer tensors), a 1-D integer tensor or a 1-D integer numpy array,
or one of vLLM's prompt dicts (`{"prompt": text}`, `{"prompt_token_ids": ids}`). Several prompts
are a list of those, or a 2-D tensor/array (one prompt per row). Every bad prompt raises a
ValueError that names it (`prompts[1]`) and the offending value.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend


def split_prompts(prompts: Any, where: str = "prompts") -> list[Any]:
    """One entry per prompt: a string or a single token sequence is one, a 2-D tensor/array one per row."""
    if isinstance(prompts, str) or is_vllm_prompt(prompts):
        return [prompts]
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)
        raise ValueError(
            f"{where} as a {type(prompts).__name__} must be 1-D (one prompt of token ids) or 2-D "
            f"(one prompt per row), got shape {tuple(prompts.shape)}"
        )
    if isinstance(prompts, Iterable) and not isinstance(prompts, (bytes, bytearray, dict)):
        prompts = prompts if isinstance(prompts, (list, tuple)) else list(prompts)  # a generator of prompts
        # A sequence that starts with a scalar is one prompt of token ids; the token checks name a
        # bad element (a float, a bool) instead of calling it a prompt of its own.
        return [prompts] if prompts and _is_scalar(prompts[0]) else list(prompts)
    raise ValueError(
        f"{where} must be a string, a sequence of token ids, a vLLM prompt dict, or a list of those; "
        f"got {type(prompts).__name__} {prompts!r:.60}"
    )


def split_model_input(data: Any) -> tuple[list[Any], str]:
    """A trace or invoke input (a prompt, prompts or a tokenizer's output) as (prompts, the name to report them by)."""
    if isinstance(data, dict) or hasattr(data, "input_ids"):
        prompts, where = unmasked_rows(data), "input_ids"
    else:
        prompts, where = split_prompts(data, "input"), "input"
    if not prompts:
        raise ValueError(f"{where} holds no prompts, got {data!r:.60}")
    return prompts, where


def unmasked_rows(encoding: Any) -> list[Any]:
    """The prompts of a tokenizer's output (a dict or BatchEncoding): `input_ids` rows, less masked-out positions."""
    if "input_ids" not in encoding:
        raise ValueError(f"a dict input needs input_ids, got keys {', '.join(map(str, encoding)) or 'none'}")
    rows = split_prompts(encoding["input_ids"], "input_ids")
    mask = encoding.get("attention_mask")
    if mask is None:
        return rows
    mask_rows = split_prompts(mask, "attention_mask")
    if len(mask_rows) != len(rows) or any(len(keep) != len(row) for keep, row in zip(mask_rows, rows)):
        raise ValueError(
            f"attention_mask ({[len(keep) for keep in mask_rows]} positions per row) does not match "
            f"input_ids ({[len(row) for row in rows]})"
        )
    return [[token for token, keep in zip(row, keeps) if keep] for row, keeps in zip(rows, mask_rows)]


def tokenize_prompt(prompt: Any, where: str, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt; ValueError naming `where` when it cannot be used."""
    if isinstance(prompt, dict):
        return _tokenize_vllm_prompt(prompt, where, tokenizer, vocab_size)
    if isinstance(prompt, str):
        return prompt, _encode(prompt, where, tokenizer, vocab_size)
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        prompt = _array_to_list(prompt, where)
    elif not isinstance(prompt, (list, tuple)):
        raise ValueError(
            f"{where} must be a string, a sequence of token ids or a vLLM prompt dict, "
            f"got {type(prompt).__name__} "
            f"{prompt!r:.60}"
        )
    if not prompt:
        raise ValueError(f"{where} has no token ids")
    if all(type(token) is int for token in prompt) and 0 <= min(prompt) and max(prompt) < vocab_size:
        return None, list(prompt)  # plain ints in range (the common case): no per-token calls
    return None, [_token_id(token, where, position, vocab_size) for position, token in enumerate(prompt)]


# vLLM's TextPrompt / TokensPrompt keys. `cache_salt` only keeps vLLM's prefix cache from sharing
# KV between users; nnrun shares no KV between requests, so it has nothing to do here.
VLLM_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
VLLM_IGNORED_KEYS = frozenset({"cache_salt"})
VLLM_MULTIMODAL_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"})


def is_vllm_prompt(value: Any) -> bool:
    """Whether `value` is one of vLLM's prompt dicts (TextPrompt or TokensPrompt), not a tokenizer's output."""
    return isinstance(value, dict) and ("prompt" in value or "prompt_token_ids" in value)


def _tokenize_vllm_prompt(prompt: dict, where: str, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a vLLM prompt dict: the ids when it has them, else its text tokenized."""
    unknown = sorted(map(str, set(prompt) - VLLM_PROMPT_KEYS - VLLM_IGNORED_KEYS - VLLM_MULTIMODAL_KEYS))
    if unknown:
        raise ValueError(
            f"{where} has keys nnrun does not know: {', '.join(unknown)} (a vLLM prompt dict has "
            f"'prompt' (text) or 'prompt_token_ids')"
        )
    multimodal = sorted(key for key in VLLM_MULTIMODAL_KEYS if prompt.get(key))
    if multimodal:
        raise ValueError(f"{where} has {', '.join(multimodal)}: nnrun serves text-only language models")
    if "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{where}['prompt'] must be the ids' text (a string), got {type(text).__name__}")
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str):
            raise ValueError(f"{where}['prompt_token_ids'] must be token ids, got a string")
        return text, tokenize_prompt(ids, f"{where}['prompt_token_ids']", tokenizer, vocab_size)[1]
    if "prompt" not in prompt:
        raise ValueError(
            f"{where} needs 'prompt' (text) or 'prompt_token_ids', got keys {', '.join(map(str, prompt)) or 'none'}"
        )
    text = prompt["prompt"]
    if not isinstance(text, str):
        raise ValueError(
            f"{where}['prompt'] must be text, got {type(text).__name__} {text!r:.60}; "
            f"token ids go in 'prompt_token_ids'"
        )
    return text, _encode(text, f"{where}['prompt']", tokenizer, vocab_size)


def _token_id(token: Any, where: str, position: int, vocab_size: int) -> int:
    """`token` as a Python int in [0, vocab_size): ints, numpy integers and 0-d integer tensors qualify."""
    if isinstance(token, torch.Tensor) and token.ndim == 0 and is_integer_dtype(token.dtype):
        token = token.item()
    if isinstance(token, bool) or not isinstance(token, numbers.Integral):
        raise ValueError(
            f"{where} token id {token!r} at position {position} is not an integer (got {type(token).__name__})"
        )
    token = int(token)
    if not 0 <= token < vocab_size:
        raise ValueError(f"{where} token id {token} at position {position} is out of the vocabulary [0, {vocab_size})")
    return token


def _encode(text: str, where: str, tokenizer: Any, vocab_size: int) -> list[int]:
    if not text:
        raise ValueError(f"{where} is an empty string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{where} contains a lone surrogate {text[error.start]!r} at position {error.start} "
            f"that cannot be encoded as UTF-8"
        ) from None
    if tokenizer is None:
        raise ValueError(f"{where} is text but the model has no tokenizer; pass token ids or tokenizer=")
    token_ids = text_token_ids(text, tokenizer)
    if not token_ids:
        raise ValueError(f"{where} {text!r:.60} tokenizes to no token ids")
    outside = [token for token in token_ids if not 0 <= token < vocab_size]
    if outside:  # a tokenizer with added tokens the model has no embedding rows for
        raise ValueError(f"{where} tokenizes to id {outside[0]}, outside the model's vocabulary [0, {vocab_size})")
    return token_ids


def text_token_ids(text: str, tokenizer: Any) -> list[int]:
    """`tokenizer(text)["input_ids"]` as Python ints; an HF fast tokenizer's ids come straight from its backend.

    For one string with default arguments, HF's `__call__` comes down to: the backend without
    truncation or padding, its `encode_special_tokens` set to `split_special_tokens`, one encode
    with special tokens, the too-long warning. When the backend is already in that state, the
    same encode here gives the same ids without building two BatchEncodings. Anything else (a
    tokenizer class that overrides a step, a backend left truncating) takes HF's own path, which
    also resets the backend for the next call.
    """
    if _is_plain_fast_tokenizer(tokenizer):
        backend = tokenizer._tokenizer
        if (
            backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == tokenizer.split_special_tokens
        ):
            # `encode`, not HF's one-item `encode_batch`: the same ids, without handing the GIL
            # and the work to the tokenizer's thread pool (which the engine thread then contends with).
            token_ids = backend.encode(text, add_special_tokens=True).ids
            tokenizer._eventual_warn_about_too_long_sequence(token_ids, None, True)
            return token_ids
    return [int(token) for token in tokenizer(text)["input_ids"]]


def _is_plain_fast_tokenizer(tokenizer: Any) -> bool:
    """Whether `tokenizer(text)` runs HF's fast-tokenizer steps unchanged (no subclass overrides one)."""
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, TokenizersBackend)
        and cls.__call__ is PreTrainedTokenizerBase.__call__
        and cls._get_padding_truncation_strategies is PreTrainedTokenizerBase._get_padding_truncation_strategies
        and cls._encode_plus is TokenizersBackend._encode_plus
        and cls.set_truncation_and_padding is TokenizersBackend.set_truncation_and_padding
        and cls._convert_encoding is TokenizersBackend._convert_encoding
        and not hasattr(cls, "_switch_to_input_mode")
    )  # translation tokenizers switch language modes


def _array_to_list(array: torch.Tensor | np.ndarray, where: str) -> list[int]:
    if array.ndim != 1:
        raise ValueError(f"{where} as a {type(array).__name__} must be 1-D token ids, got shape {tuple(array.shape)}")
    if isinstance(array, torch.Tensor):
        if not is_integer_dtype(array.dtype):
            raise ValueError(f"{where} must hold integer token ids, got a tensor of {array.dtype}")
        if array.device.type == "meta":
            raise ValueError(f"{where} is a meta tensor: it has no token ids to read")
        return array.tolist()
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{where} must hold integer token ids, got a numpy array of {array.dtype}")
    return array.tolist()


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` can hold token ids (no floats, complex numbers or bools)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _is_scalar(value: Any) -> bool:
    """A single number (a token id or a mistaken one), as opposed to a prompt."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 0
    return isinstance(value, (numbers.Number, np.generic)) and not isinstance(value, (str, bytes))
