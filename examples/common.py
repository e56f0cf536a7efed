"""What the example scripts share: their command line, where a model family keeps its blocks, token labels."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

# (decoder blocks, attention inside a block, final norm) as HF module paths; the unembedding is
# wherever the model's get_output_embeddings() is.
LAYOUTS = (
    ("model.layers", "self_attn", "model.norm"),  # Llama, Mistral, Qwen2/3, Gemma2/3, Phi3, OLMo2
    ("transformer.h", "attn", "transformer.ln_f"),  # GPT-2
    ("gpt_neox.layers", "attention", "gpt_neox.final_layer_norm"),  # GPT-NeoX, Pythia
)


@dataclass(frozen=True)
class Layout:
    """A model's envoys for the parts the examples touch, and their HF paths."""

    layers_path: str
    attn_name: str
    layers: Any  # the envoy of the decoder block list: layers[i].output is block i's residual output
    norm: Any
    unembed: Any


def module_path(hf_model: torch.nn.Module, module: torch.nn.Module) -> str:
    """The HF path of one of `hf_model`'s modules, e.g. of `hf_model.get_input_embeddings()`."""
    return next(name for name, candidate in hf_model.named_modules() if candidate is module)


def layout_paths(hf_model: torch.nn.Module) -> tuple[str, str, str, str]:
    """The HF paths of an HF causal LM's parts: (blocks, attention in a block, final norm, unembedding)."""
    for paths in LAYOUTS:
        if hasattr(hf_model, paths[0].split(".")[0]):
            return (*paths, module_path(hf_model, hf_model.get_output_embeddings()))
    known = ", ".join(paths[0] for paths in LAYOUTS)
    raise ValueError(f"no known decoder layout in {type(hf_model).__name__} (looked for {known}); add it to LAYOUTS")


def find_layout(model: Any) -> Layout:
    """The envoys of an `nnrun.LanguageModel`'s blocks, final norm and unembedding."""
    layers_path, attn_name, norm_path, unembed_path = layout_paths(model.engine.model)
    return Layout(layers_path, attn_name, model.get(layers_path), model.get(norm_path), model.get(unembed_path))


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every example takes: --model and --device."""
    result = argparse.ArgumentParser(description=description)
    result.add_argument(
        "--model",
        default="tiny-facts",
        help="a bundled model (tiny-facts, tiny-facts-gpt2), an HF hub id or a checkpoint folder",
    )
    result.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    return result


def single_token_id(tokenizer: Any, text: str) -> int:
    """The id of `text` (e.g. " Paris"), which should be one token; else its first token, with a note."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        print(f"note: {text!r} is {len(ids)} tokens for this tokenizer; using its first")
    return ids[0]


def token_labels(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Readable labels for token ids: decoded text, with spaces shown as '_'."""
    return [tokenizer.decode([i]).replace(" ", "_").replace("\n", "\\n") for i in token_ids]


def top_tokens(tokenizer: Any, logits: torch.Tensor, k: int = 3) -> str:
    """`' Paris' 0.97, ' Rome' 0.01, ...` from one position's logits `[vocab]`."""
    probs = logits.float().softmax(-1)  # [vocab]
    values, ids = probs.topk(k)
    return ", ".join(f"{tokenizer.decode([i])!r} {p:.2f}" for p, i in zip(values.tolist(), ids.tolist()))
