"""nnrun: nnsight's API and HuggingFace's exact semantics on a continuous-batching engine."""

from __future__ import annotations

from typing import Any

from nnrun.engine import LLM, RequestHandle
from nnrun.outputs import CompletionOutput, RequestOutput
from nnrun.sampling_params import SamplingParams

__version__ = "0.1.0"

# The nnsight bridge and the extraction jobs import heavier packages: load them on first use.
_LAZY = {
    "LanguageModel": ("interleaver.model", "LanguageModel"),
    "TransformersModel": ("interleaver.model", "TransformersModel"),
    "VLLM": ("interleaver.vllm", "VLLM"),
    "extract": ("nnrun.extract", "extract"),
    "load_activations": ("nnrun.extract", "load_activations"),
    "bundled_model_path": ("nnrun.assets", "bundled_model_path"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'nnrun' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    return getattr(importlib.import_module(module_name), attr)


__all__ = ["LLM", "CompletionOutput", "RequestHandle", "RequestOutput", "SamplingParams", *_LAZY]
