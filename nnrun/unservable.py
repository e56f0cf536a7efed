"""Models refused at load by what their class is, before nnrun builds, probes or serves them.

Every refusal names the family and the capability nnrun lacks. Checked on the model class alone,
so a checkpoint or config is refused before its weights are built.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Iterator

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from nnrun.exact.probe import ModelRefusedError


def refuse_unservable(model_class: type, family: str, config: PretrainedConfig | None = None) -> None:
    """Raise `ModelRefusedError` for a causal-LM class nnrun cannot serve at all, saying why."""
    if "shared_kv_states" in inspect.signature(model_class.forward).parameters:
        # Gemma 4's assistants: multi-token-prediction drafters whose forward raises without these inputs
        raise ModelRefusedError(
            f"{family}: {model_class.__name__} is a drafter (assistant) model for assisted decoding: its forward "
            "reads the target model's hidden states and KV states (inputs_embeds and shared_kv_states), not a "
            "prompt's token ids, so it cannot run on its own; nnrun runs standalone causal language models "
            "(serve the target model instead)"
        )
    modalities = tuple(getattr(model_class, "output_modalities", None) or ("text",))
    if "text" not in modalities:
        raise ModelRefusedError(
            f"{family}: {model_class.__name__} generates {'/'.join(modalities)}, not text"
            f"{_codebooks(config)}; nnrun runs text causal language models (one token stream per sequence, "
            "one vocabulary)"
        )


def causal_lm_class(config: PretrainedConfig) -> type | None:
    """The class `AutoModelForCausalLM` builds for this config, or None (remote code, or not a causal LM)."""
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    except (ImportError, AttributeError):  # its module does not import here: building it says why
        return None
    return model_class[0] if isinstance(model_class, (list, tuple)) else model_class


@contextmanager
def refusing_missing_libraries(config: PretrainedConfig) -> Iterator[None]:
    """Turn HF's error for a library the model's code needs (timm for Gemma 3n's vision tower) into a refusal."""
    try:
        yield
    except ImportError as error:
        model_class = causal_lm_class(config)
        building = f"building {model_class.__name__}" if model_class is not None else "building the model"
        # HF's message spans lines (what is missing, then how to install it): one line, without its restart note
        reason = " ".join(str(error).split()).split(" Please note")[0] or type(error).__name__
        raise ModelRefusedError(
            f"{config.model_type}: {building} needs a library that is not installed ({reason})"
        ) from error


def _codebooks(config: PretrainedConfig | None) -> str:
    """MusicGen's case: parallel streams of audio codes, one head each."""
    if config is None:
        return ""
    decoder = config.get_text_config(decoder=True)
    num_codebooks = getattr(decoder, "num_codebooks", None)
    if not isinstance(num_codebooks, int) or num_codebooks < 2:
        return ""
    return (
        f" (it reads and predicts {num_codebooks} parallel codebooks of audio codes per position: input_ids "
        f"of shape [batch * {num_codebooks}, T], one output head per codebook)"
    )
