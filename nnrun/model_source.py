"""What every entry point that takes a model accepts, and the one-line refusal of anything else.

`nnrun.LLM`, `nnrun.LanguageModel`/`VLLM` and `nnrun.extract` take a model name or checkpoint folder,
a transformers `PreTrainedModel` (or, for `load_format="dummy"`, its config), or an object that
already holds a model: an `nnrun.LLM`, an nnrun `LanguageModel`/`VLLM` (its engine) or nnsight's
own `LanguageModel` on HF (the HF model it wraps). Anything else is refused by its type name, never
by its repr (a module's repr is its whole tree).
"""

from __future__ import annotations

import os
from typing import Any

ACCEPTED = (
    "a model name or checkpoint folder (e.g. 'tiny-facts'), a transformers PreTrainedModel, "
    "an nnrun.LLM, or an nnrun/nnsight LanguageModel"
)


def engine_of(model: Any) -> Any:
    """The nnrun engine `model` is or holds (an `nnrun.LLM`, or a `LanguageModel`/`VLLM`'s), else None."""
    from nnrun.engine import LLM

    if isinstance(model, LLM):
        return model
    try:  # an nnsight tree answers unknown names through its own __getattr__: ask without trusting it
        engine = object.__getattribute__(model, "engine")
    except AttributeError:
        return None
    return engine if isinstance(engine, LLM) else None


def as_model_source(model: Any, tokenizer: Any = None) -> tuple[Any, Any]:
    """`(model, tokenizer)` as the loader takes them: a name/folder string, a PreTrainedModel or a config.

    An engine's model is reused in memory (its tokenizer unless `tokenizer` is given); a tensor-parallel
    engine's weights live on its ranks, so its checkpoint is named again.
    """
    engine = engine_of(model)
    if engine is not None:
        tokenizer = engine.tokenizer if tokenizer is None else tokenizer
        if engine.config.parallel.tensor_parallel_size > 1:
            return engine.config.model.model, tokenizer
        return engine.model, tokenizer
    wrapped = _nnsight_wrapped_model(model)
    if wrapped is not None:
        return wrapped, getattr(model, "tokenizer", None) if tokenizer is None else tokenizer
    check_model_source(model)
    return (os.fspath(model) if isinstance(model, os.PathLike) else model), tokenizer


def check_model_source(model: Any) -> None:
    """Raise a one-line TypeError unless the loader can take `model` (None and '' are ModelConfig's to refuse)."""
    from transformers import PretrainedConfig, PreTrainedModel

    if model is None or isinstance(model, (str, os.PathLike, PreTrainedModel, PretrainedConfig)):
        return
    raise TypeError(f"cannot use an object of type {describe(model)} as a model; pass {ACCEPTED}")


def describe(value: Any) -> str:
    """A value's type name, with what it is when that helps (a torch module that is not an HF model)."""
    import torch

    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, torch.nn.Module):
        return f"{name} (a torch module, not a transformers PreTrainedModel)"
    return name


def _nnsight_wrapped_model(model: Any) -> Any:
    """The HF model inside nnsight's own `LanguageModel`/`NNsight` wrapper, else None."""
    from transformers import PreTrainedModel

    if not type(model).__module__.startswith("nnsight."):
        return None
    try:
        wrapped = object.__getattribute__(model, "_module")  # nnsight 0.5+ keeps the wrapped module here
    except AttributeError:
        return None
    return wrapped if isinstance(wrapped, PreTrainedModel) else None
