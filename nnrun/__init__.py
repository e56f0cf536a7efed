"""nnrun: nnsight's API and HuggingFace's exact semantics on a continuous-batching engine.

`import nnrun` loads no torch: every public name below is imported on first use, so the engine
(torch, transformers' model code), the nnsight bridge, extraction, tensor parallelism, serving,
Ray and FlashInfer cost nothing until a script touches them (`benchmarks/startup.py`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from nnrun.sampling_params import SamplingParams  # plain dataclasses: no torch

if TYPE_CHECKING:
    from interleaver.model import LanguageModel
    from interleaver.vllm import VLLM
    from nnrun.assets import bundled_model_path
    from nnrun.engine import LLM, RequestHandle
    from nnrun.extract import extract, load_activations
    from nnrun.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"

# public name -> (module, attribute), imported when first asked for
_LAZY = {
    "LLM": ("nnrun.engine", "LLM"),
    "RequestHandle": ("nnrun.engine", "RequestHandle"),
    "CompletionOutput": ("nnrun.outputs", "CompletionOutput"),
    "RequestOutput": ("nnrun.outputs", "RequestOutput"),
    "LanguageModel": ("interleaver.model", "LanguageModel"),
    "TransformersModel": ("interleaver.model", "TransformersModel"),
    "VLLM": ("interleaver.vllm", "VLLM"),
    "extract": ("nnrun.extract", "extract"),
    "load_activations": ("nnrun.extract", "load_activations"),
    "bundled_model_path": ("nnrun.assets", "bundled_model_path"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        if name != "extract":  # importing the package nnrun.extract binds that name itself (a callable module)
            globals()[name] = value
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # `nnrun.config` after a bare `import nnrun`
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'nnrun' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "LLM",
    "VLLM",
    "CompletionOutput",
    "LanguageModel",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "TransformersModel",
    "bundled_model_path",
    "extract",
    "load_activations",
]
