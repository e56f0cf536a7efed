"""Compare what a scenario saved on nnsight-on-HF with what it saved on nnrun (fp32, 1e-4)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers.utils import ModelOutput

from conformance.scenarios import SCENARIOS, Padded
from tolerance import assert_close_packed

REL = 1e-4  # of each value's magnitude: nnrun's packed forward sums in another order than HF's padded one


def assert_scenario_same(name: str, oracle: Any, ours: Any, tokenizer: Any) -> None:
    """Run scenario `name` on nnsight-on-HF and on nnrun (nnsight's warnings silenced); its saves must agree."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = SCENARIOS[name](oracle, tokenizer)
        actual = SCENARIOS[name](ours, tokenizer)
    assert_same(expected, actual, name)


def assert_same(expected: Any, actual: Any, where: str = "") -> None:
    if isinstance(expected, Padded):
        assert isinstance(actual, Padded), f"{where}: expected a padded value"
        _assert_real_tokens(expected.value, actual.value, expected.lengths, where)
    elif isinstance(expected, ModelOutput):
        assert_same(expected.logits, actual.logits, f"{where}.logits")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != HF's {tuple(expected.shape)}"
        assert_close_packed(actual, expected, rel=REL, msg=where)
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: saved {sorted(actual)} != HF's {sorted(expected)}"
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}.{key}" if where else key)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: {len(actual)} items != HF's {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != HF's {expected!r}"


def _assert_real_tokens(expected: torch.Tensor, actual: torch.Tensor, lengths: list[int], where: str) -> None:
    """Rows are left-padded (HF to its whole batch, nnrun to the invoke): compare the trailing real tokens."""
    assert actual.shape[0] == expected.shape[0] == len(lengths), f"{where}: rows {actual.shape[0]} != {len(lengths)}"
    assert actual.shape[2:] == expected.shape[2:], f"{where}: {tuple(actual.shape)} vs HF's {tuple(expected.shape)}"
    for row, length in enumerate(lengths):
        assert actual.shape[1] >= length, f"{where}: row {row} has {actual.shape[1]} positions, fewer than {length}"
        ours = actual[row, actual.shape[1] - length :]
        theirs = expected[row, expected.shape[1] - length :]
        if ours.is_floating_point():
            assert_close_packed(ours, theirs, rel=REL, msg=f"{where}[row {row}]")
        else:
            assert torch.equal(ours, theirs), f"{where}[row {row}]: {ours.tolist()} != HF's {theirs.tolist()}"
