"""Walking the nested values a module hands over (tensors inside tuples, lists, dicts, ModelOutputs)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from nnsight.util import apply

from interleaver.layouts import module_of
from interleaver.write_checks import InvalidWriteError
from nnrun.attention.probabilities import AttentionProbs

LEAF_TYPES = (torch.Tensor, AttentionProbs)  # what a batcher slices; everything else every request shares


def merge_edited(location: str, full: Any, edited: Any, merge_leaf: Callable[[Any, Any], Any]) -> Any:
    """`full` with each leaf replaced by `merge_leaf(full_leaf, edited_leaf)`; shared values must stay as they are."""
    if isinstance(full, LEAF_TYPES):
        return merge_leaf(full, edited)
    if isinstance(full, (list, tuple)) and isinstance(edited, (list, tuple)) and _pairs_with(full, edited):
        merged = [merge_edited(location, f, e, merge_leaf) for f, e in zip(full, edited)]
        merged += full[len(edited) :]  # trailing Nones a rebuilt argument tuple left out: the same call
        if isinstance(full, tuple) and hasattr(full, "_fields"):
            return type(full)(*merged)
        return type(full)(merged)
    if isinstance(full, dict) and isinstance(edited, dict):
        merged = full.copy()
        for key in full:
            if key in edited:
                merged[key] = merge_edited(location, full[key], edited[key], merge_leaf)
        return merged
    if edited is not full and not _same_value(full, edited):
        raise InvalidWriteError(
            f"{module_of(location)}: cannot replace {type(full).__name__} {full!r:.40} with "
            f"{type(edited).__name__} {edited!r:.40}: it is not a per-token value of this request (every "
            "request in the step shares it), so one trace cannot change it"
        )
    return full


def paired_tensors(full: Any, served: Any) -> list[tuple[torch.Tensor | AttentionProbs, Any]]:
    """(leaf of `full`, the tensor at the same place in `served`) for every such place."""
    if isinstance(full, LEAF_TYPES):
        return [(full, served)] if isinstance(served, torch.Tensor) else []
    if isinstance(full, (list, tuple)) and isinstance(served, (list, tuple)):
        return [pair for f, s in zip(full, served) for pair in paired_tensors(f, s)]
    if isinstance(full, dict) and isinstance(served, dict):
        return [pair for key in full if key in served for pair in paired_tensors(full[key], served[key])]
    return []


def tensors_in(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply(value, found.append, torch.Tensor)
    return found


def concat_dim1(structures: list) -> Any:
    """Structures of `[1, n_i, ...]` tensors joined along dim 1, leaf by leaf (other leaves: the first's)."""
    first = structures[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(structures, dim=1) if first.dim() >= 2 else first
    if isinstance(first, (list, tuple)):
        return type(first)(concat_dim1([s[i] for s in structures]) for i in range(len(first)))
    if isinstance(first, dict):
        return {key: concat_dim1([s[key] for s in structures]) for key in first}
    return first


def _pairs_with(full: list | tuple, edited: list | tuple) -> bool:
    """Whether `edited` lines up with `full` entry by entry: the same length, or `full` less trailing Nones.

    A block that rebuilds a module's `.inputs` (`((new_hidden,),) + module.inputs[1:]`) writes an args
    tuple of the positional values it knows; a module such as GPT-2's block is called with further
    positional values, None on nnrun's packed step (the cache and mask live in the engine). Leaving a
    None out of the call is passing it, so those are the same call.
    """
    if len(edited) == len(full):
        return True
    return len(edited) < len(full) and all(value is None for value in full[len(edited) :])


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a plain truth value
        return False
