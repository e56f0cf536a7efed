"""What an assignment into a packed step may be: the errors a bad one raises, and the checks.

A block's assignment is checked where it is made, so the error is thrown into the block at the
user's line and ends that request only (never the step the other requests share).
"""

from __future__ import annotations

from typing import Any

import torch

from interleaver.layouts import LOGITS_LOCATION, SAMPLES_LOCATION, module_of
from nnrun.prompts import is_integer_dtype


class InvalidWriteError(ValueError):
    """An assignment the step cannot take: thrown into the block at its line, ending that request only."""


class AmbiguousLayoutError(InvalidWriteError):
    """A `.source` value whose token dim cannot be told from the step's layout."""


class ShapeMismatchError(InvalidWriteError):
    """An assignment whose tensor does not have the shape of the value it replaces."""


def checked_write(
    location: str, full: torch.Tensor, edited: Any, expected: tuple[int, ...], vocab_size: int | None
) -> torch.Tensor:
    """`edited` as a tensor the step can take in place of a request's part of `full`, or an error."""
    where = module_of(location)
    if isinstance(edited, bool) or not isinstance(edited, (torch.Tensor, int, float)):
        raise InvalidWriteError(
            f"{where}: cannot assign {type(edited).__name__} {edited!r:.40}; assign a "
            f"tensor of shape {expected} (or a number)"
        )
    if not isinstance(edited, torch.Tensor):
        edited = torch.as_tensor(edited, dtype=full.dtype, device=full.device).expand(expected)
    if edited.is_meta:
        raise InvalidWriteError(f"{where}: cannot assign a meta tensor (it has a shape but no values)")
    if tuple(edited.shape) != expected:
        raise ShapeMismatchError(
            f"{where}: cannot assign a value of shape {tuple(edited.shape)} where the model has shape {expected}"
        )
    if location == SAMPLES_LOCATION:
        check_token_ids(edited, vocab_size, where)
    elif location == LOGITS_LOCATION and edited.is_floating_point() and bool(edited.isnan().any()):
        raise InvalidWriteError(f"{where}: cannot assign logits containing NaN (use -inf to rule a token out)")
    return edited


def check_token_ids(token_ids: torch.Tensor, vocab_size: int | None, where: str) -> None:
    """Raise InvalidWriteError unless `token_ids` are integers in the vocabulary."""
    if not is_integer_dtype(token_ids.dtype):
        raise InvalidWriteError(f"{where}: token ids must be integers, got {token_ids.dtype}")
    if vocab_size is None or token_ids.numel() == 0:
        return
    low, high = int(token_ids.min()), int(token_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidWriteError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})")
