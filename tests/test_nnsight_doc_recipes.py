"""docs/nnsight.md's generation recipes run as written, and save on nnrun what they save on nnsight over HF."""

from __future__ import annotations

import linecache
import re
import warnings
from pathlib import Path

import pytest

from conformance.compare import assert_same

DOC = Path(__file__).resolve().parents[1] / "docs" / "nnsight.md"
# What each recipe saves, compared with nnsight's: the names its block binds with `.save()`.
SAVED = [["rome", "paris", "steered"], ["hidden"], ["top", "tokens"], ["out", "ids"]]


def recipe_blocks() -> list[str]:
    section = DOC.read_text().split("## Generation recipes", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def run(block: str, namespace: dict, name: str) -> None:
    """Run a doc block as a script would: nnsight reads a `with` block's body back from its source."""
    filename = f"<docs/nnsight.md: {name}>"
    linecache.cache[filename] = (len(block), None, block.splitlines(keepends=True), filename)
    exec(compile(block, filename, "exec"), namespace)


@pytest.fixture(scope="module")
def namespaces():
    """The setup block run twice: as written (nnrun), and with nnsight over the same HF checkpoint as `model`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conformance.models import hf_language_model
    from nnrun.assets import bundled_model_path

    setup = recipe_blocks()[0]
    ours: dict = {}
    run(setup, ours, "setup")
    theirs: dict = {}
    run(setup, theirs, "setup")  # its nnrun model is never traced there, so it never loads its weights
    assert not theirs["model"].dispatched
    path = bundled_model_path("tiny-facts")
    theirs["model"] = hf_language_model(
        AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    )
    yield ours, theirs
    ours["model"].shutdown()


def test_the_doc_has_the_four_recipes():
    assert len(recipe_blocks()) == 1 + len(SAVED)


@pytest.mark.parametrize("index", range(len(SAVED)), ids=["steer", "every_step", "fixed_length", "result"])
def test_recipe_runs_and_matches_nnsight(namespaces, index):
    ours, theirs = namespaces
    block = recipe_blocks()[1 + index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nnsight's deprecation and cut-short-loop warnings
        run(block, theirs, f"recipe {index}")
        run(block, ours, f"recipe {index}")
    for name in SAVED[index]:
        assert_same(theirs[name], ours[name], name)
    if index == 0:  # what the recipe's comment promises
        assert "Rome" in ours["model"].tokenizer.decode(ours["steered"][0])
