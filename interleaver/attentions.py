"""The `output_attentions` keyword: engine request arguments on the client, per-invoke values on the engine.

HF's keyword: a prompt that passes `output_attentions=True` (to `trace`, `generate` or its
`invoke`; an invoke's keyword wins) sees its attention probabilities as the second output of
every attention module; the engine computes them only for such requests (see
nnrun/attention/probabilities.py). Prompts that do not ask see None there, as with HF's sdpa.
"""

from __future__ import annotations

import torch

from nnrun.attention.probabilities import AttentionProbs
from nnrun.forward_batch import OUTPUT_ATTENTIONS_ARG

ATTENTION_KWARGS = ("output_attentions",)


def attention_args(kwargs: dict) -> dict:
    """The engine `extra_args` of a prompt whose keywords (trace's, then its invoke's) are `kwargs`."""
    value = kwargs.get("output_attentions")
    if value is None:  # HF's default
        return {}
    if not isinstance(value, bool):
        raise TypeError(f"output_attentions must be True or False, got {type(value).__name__} {value!r:.40}")
    return {OUTPUT_ATTENTIONS_ARG: True} if value else {}


def check_spanning_invokes(request_ids: list[list[str]], args: dict[str, dict]) -> None:
    """An empty invoke spans every prompt of the trace: they must agree on output_attentions."""
    if all(request_ids) or len({bool(a) for a in args.values()}) <= 1:
        return
    raise ValueError(
        "an empty invoke spans every prompt of this trace, but only some of them pass "
        "output_attentions=True; pass it to trace()/generate() for all of them instead"
    )


# ---- serving an attention module's second output (the batcher's part) ----------------------------


def narrow_probs(probs: AttentionProbs, rows: list[int]) -> torch.Tensor | None:
    """What an invoke over batch `rows` sees: its one request's `[1, H, n, L]`, several requests
    left-padded as HF eager returns a padded batch, or None unless every one of them asked.

    (Only a block spanning every prompt of a trace, a stored `model.edit()`, can span prompts that
    differ: `check_spanning_invokes` refuses empty invokes over such prompts.)"""
    tensors = [probs.for_row(row) for row in rows]  # each [1, H, n_i, L_i] or None
    if any(t is None for t in tensors):
        return None
    if len(tensors) == 1:
        return tensors[0]
    return left_padded_probs(tensors)


def left_padded_probs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """HF eager on a left-padded batch: each request's queries and keys bottom-right, padded keys 0,
    and a padded query (all its keys masked, so softmax of equal scores) spread evenly over every key."""
    max_q = max(t.shape[2] for t in tensors)
    max_kv = max(t.shape[3] for t in tensors)
    first = tensors[0]
    out = first.new_full((len(tensors), first.shape[1], max_q, max_kv), 1.0 / max_kv)  # [k, H, n_max, L_max]
    for i, t in enumerate(tensors):
        num_q, num_kv = t.shape[2], t.shape[3]
        out[i, :, max_q - num_q :] = 0.0
        out[i, :, max_q - num_q :, max_kv - num_kv :] = t[0]
    return out


def unpadded_probs(probs: AttentionProbs, rows: list[int], padded: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each row's own part (bottom-right, its current shape) of a left-padded `[k, H, n_max, L_max]`."""
    parts = {}
    for i, row in enumerate(rows):
        num_q, num_kv = probs.for_row(row).shape[2:]
        parts[row] = padded[i : i + 1, :, padded.shape[2] - num_q :, padded.shape[3] - num_kv :]  # [1, H, n, L]
    return parts


def scatter_probs(probs: AttentionProbs, rows: list[int], served: torch.Tensor) -> None:
    """In-place edits of a several-request copy land in each request's own tensor, as they would in HF's."""
    if served.dim() != 4 or served.shape[0] != len(rows) or any(probs.for_row(row) is None for row in rows):
        return
    for row, part in unpadded_probs(probs, rows, served).items():
        probs.for_row(row).copy_(part)
