"""Activation extraction over two tensor-parallel ranks: bytes the same run to run, values as one rank's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

import nnrun
from nnrun.cli import main as cli_main
from nnrun.extract import SettingsMismatchError
from tolerance import assert_close_packed

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is Jupiter and", "Paris"]
MODULES = ["model.layers.1", "model.layers.2.mlp.output", "model.layers.0.self_attn.o_proj", "model.norm"]
TP2 = {"tensor_parallel_size": 2, "tensor_parallel_timeout": 60}


def _shard_digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.glob("shard-*"))}


def test_two_ranks_write_the_same_bytes_run_to_run_and_one_rank_s_values(tmp_path):
    first, second, single = tmp_path / "tp2-a", tmp_path / "tp2-b", tmp_path / "tp1"
    nnrun.extract("tiny-facts", PROMPTS, MODULES, first, progress=False, llm_kwargs=TP2)
    nnrun.extract("tiny-facts", PROMPTS, MODULES, second, progress=False, llm_kwargs=TP2)
    nnrun.extract("tiny-facts", PROMPTS, MODULES, single, progress=False)
    assert _shard_digests(first) and _shard_digests(first) == _shard_digests(second)
    ours, theirs = nnrun.load_activations(first), nnrun.load_activations(single)
    assert len(ours) == len(PROMPTS)
    for i in range(len(PROMPTS)):
        for name in MODULES:
            assert ours[i][name].shape == theirs[i][name].shape, name
            assert_close_packed(ours[i][name], theirs[i][name], msg=f"prompt {i} {name}")
    # A folder written by two ranks is not resumed by one: the float rounding differs.
    with pytest.raises(SettingsMismatchError, match="tensor_parallel_size"):
        nnrun.extract("tiny-facts", PROMPTS, MODULES, first, progress=False)


def test_a_value_each_rank_holds_a_piece_of_is_refused_by_name(tmp_path):
    for module in (
        "model.layers.1.mlp.act_fn",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj.input",
    ):
        with pytest.raises(
            ValueError, match=f"module '{module}': with tensor_parallel_size=2 each rank holds only a piece"
        ):
            nnrun.extract("tiny-facts", PROMPTS[:1], [module], tmp_path / module, progress=False, llm_kwargs=TP2)


def test_the_command_extracts_over_ranks(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out"
    command = ["extract", "--model", "tiny-facts", "--input", str(prompts), "--module", "model.layers.1"]
    assert cli_main([*command, "--out", str(out), "--tensor-parallel-size", "2", "--quiet"]) == 0
    store = nnrun.load_activations(out)
    assert len(store) == len(PROMPTS) and torch.isfinite(store[0]["model.layers.1"]).all()
