"""Tiny pretrained models bundled with nnrun, so demos and tests run offline on real facts.

tiny-facts (Llama, grouped-query attention) and tiny-facts-gpt2 (GPT-2) are trained by
`python -m nnrun.assets.train_tiny` on templated sentences about landmarks, cities, countries and
people; facts.jsonl lists one prompt per fact whose next token is the answer. tiny-facts is also
trained so that a subject's identity sits at its last token after decoder layer 1 (see
interchange.py), which gives activation-patching demos a known ground truth.

This module imports nothing heavy: it only knows where the files are.
"""

import json
from dataclasses import dataclass
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
BUNDLED_MODELS = ("tiny-facts", "tiny-facts-gpt2")
FACTS_PATH = ASSETS_DIR / "facts.jsonl"


@dataclass(frozen=True)
class Fact:
    """A prompt whose next token should be answer (which starts with a space)."""

    prompt: str
    answer: str
    relation: str
    subject: str


def is_bundled_model(name: str) -> bool:
    """Whether name is one of BUNDLED_MODELS."""
    return name in BUNDLED_MODELS


def bundled_model_path(name: str) -> Path:
    """The HF checkpoint folder of a bundled model, loadable with from_pretrained."""
    if not is_bundled_model(name):
        raise ValueError(f"unknown bundled model {name!r}; known: {', '.join(BUNDLED_MODELS)}")
    return ASSETS_DIR / name


def load_facts() -> list[Fact]:
    """The facts table shipped beside the models, in file order."""
    with FACTS_PATH.open() as f:
        return [Fact(**json.loads(line)) for line in f if line.strip()]


__all__ = ["BUNDLED_MODELS", "Fact", "bundled_model_path", "is_bundled_model", "load_facts"]
