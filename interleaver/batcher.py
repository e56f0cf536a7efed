"""PackedBatcher: scope an intervention to its own requests inside one flat packed batch.

nnsight's base Batcher gives each invoke a fixed row range of a dim-0 stack. nnrun runs the HF
module tree on one flat batch `[1, N, ...]` that packs every scheduled request's new tokens, and
the set of requests changes every step. So a mediator's group is a `PackedGroup`: for each of
its member requests (one per prompt of its invoke, in invoke order) the runner writes, every
step, where that request sits in the three layouts a step produces:

- TOKENS  `[1, N, ...]`: every module of the forward (a prefill span, or one decode token);
- LOGITS  `[1, R, ...]`: the LM head and the model's output, which run on the `R` positions
  whose logits the step keeps (a traced prompt keeps all of them, a generation step one);
- ROWS    `[B, ...]`: per-request values after the forward (`model.logits`, `model.samples`).

Which layout a value is in comes from its location (`layout_of`), never from its shape. Within a
layout, a tensor whose leading dims are the packed ones (`[1, N]`, `[1, R]`, `[B]`) is sliced;
anything else (a mask, a cache object, `logits_to_keep`) is not per-token and passes whole.

A one-request group is served a view, so in-place edits land in the flat tensor, and the view is
marked `_nnsight_batch` so `.grad` redirects to the tensor in the graph. A several-request group
(a list invoke, an empty invoke) is served a gathered copy, left-padded as HF pads a batch
(`[k, T_max, ...]`); `scatter_back` writes its real tokens back after the mediator moves on.
Assignments (`widen`) never write into the flat tensor in place: the model continues from a new
tensor, so values saved earlier keep what they were, exactly as nnsight on HF behaves.

An attention module's second output is not token-packed: it is an `AttentionProbs` (per batch row,
the probabilities of the requests that passed `output_attentions=True`), served per request by the
helpers in interleaver/attentions.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from nnsight.intervention.batching import Batcher
from nnsight.intervention.source import NO_SKIP
from nnsight.util import apply

from interleaver.attentions import narrow_probs, scatter_probs, unpadded_probs
from nnrun.attention.probabilities import AttentionProbs
from nnrun.prompts import is_integer_dtype

LOGITS_LOCATION = "model.logits"
SAMPLES_LOCATION = "model.samples"
ROOT_OUTPUT_LOCATION = "model.output"


class Layout(enum.Enum):
    TOKENS = "tokens"
    LOGITS = "logits"
    ROWS = "rows"


@dataclass
class PackedGroup:
    """Where one mediator's requests sit in this step, one entry per present member request."""

    token_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, num_tokens) in [1, N]
    logit_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, num_positions) in [1, R]
    rows: list[int] = field(default_factory=list)  # row in [B, ...]

    @property
    def is_single(self) -> bool:
        return len(self.rows) == 1


class InvalidWriteError(ValueError):
    """An assignment the step cannot take: thrown into the block at its line, ending that request only."""


class AmbiguousLayoutError(InvalidWriteError):
    """A `.source` value whose token dim cannot be told from the step's layout."""


class ShapeMismatchError(InvalidWriteError):
    """An assignment whose tensor does not have the shape of the value it replaces."""


@dataclass
class _SkipParts:
    """Skip replacements gathered across the mediators at one `.skip` gate."""

    location: str
    parts: list[tuple[PackedGroup, Any]] = field(default_factory=list)


class PackedBatcher(Batcher):
    """narrow/widen/skip over nnrun's packed step, by the spans the runner computed."""

    def __init__(self, lm_head_path: str | None) -> None:
        super().__init__(envoy=None)
        self.lm_head_prefix = None if lm_head_path is None else lm_head_path + "."
        self.num_tokens = 0  # N
        self.num_logits = 0  # R
        self.num_rows = 0  # B
        self.vocab_size: int | None = None  # the range `model.samples` may be set to (set by the runner)
        self.location = ""  # the location being served now (set by the interleaver)
        self.pending_skips: dict[str, _SkipParts] = {}  # output location -> replacements to splice in

    def set_step(self, num_tokens: int, num_logits: int, num_rows: int) -> None:
        self.num_tokens, self.num_logits, self.num_rows = num_tokens, num_logits, num_rows
        self.pending_skips = {}

    @property
    def batching(self) -> bool:
        return True  # other requests always share the step

    # ---- layouts --------------------------------------------------------------------------
    def layout_of(self, location: str) -> Layout:
        if location in (LOGITS_LOCATION, SAMPLES_LOCATION):
            return Layout.ROWS
        if location == ROOT_OUTPUT_LOCATION or (self.lm_head_prefix and location.startswith(self.lm_head_prefix)):
            return Layout.LOGITS
        return Layout.TOKENS

    def _spans(self, layout: Layout, group: PackedGroup) -> list[tuple[int, int]]:
        return group.token_spans if layout is Layout.TOKENS else group.logit_spans

    def _is_packed(self, tensor: torch.Tensor, layout: Layout) -> bool:
        return self._packed_dim(tensor, layout) is not None

    def _packed_dim(self, tensor: torch.Tensor, layout: Layout) -> int | None:
        """The dim that holds the step's tokens (0 for rows), or None for a value every request shares.

        Inside a module's `.source`, attention's operations hold head-first `[1, heads, N, head_dim]`
        values (after `.transpose(1, 2)`): their tokens are dim 2. Where dims 1 and 2 both have the
        step's size, nothing says which holds the tokens, so such a read is refused rather than guessed.
        """
        if layout is Layout.ROWS:
            return 0 if tensor.dim() >= 1 and tensor.shape[0] == self.num_rows else None
        size = self.num_tokens if layout is Layout.TOKENS else self.num_logits
        if tensor.dim() < 2 or tensor.shape[0] != 1:
            return None
        token_first = tensor.shape[1] == size
        if layout is not Layout.TOKENS or ".source." not in self.location or tensor.dim() < 3:
            return 1 if token_first else None
        head_first = tensor.shape[2] == size and tensor.dtype is not torch.bool
        if token_first and head_first:
            if self.num_rows == 1:  # one request holds the whole step: either dim serves it all
                return 1
            raise AmbiguousLayoutError(
                f"{_module_of(self.location)}: cannot tell which dim of this {tuple(tensor.shape)} value holds the "
                f"step's {size} tokens (dims 1 and 2 both have that size) while other requests share the step; read "
                "the value where it is token-first (e.g. the projection's output) instead"
            )
        return 1 if token_first else 2 if head_first else None

    # ---- reads ----------------------------------------------------------------------------
    def narrow(self, value: Any, group: Any) -> Any:
        if group is None:
            return value
        layout = self.layout_of(self.location)
        return apply(value, lambda leaf: self._narrow_leaf(leaf, group, layout), (torch.Tensor, AttentionProbs))

    def _narrow_leaf(self, leaf: torch.Tensor | AttentionProbs, group: PackedGroup, layout: Layout) -> Any:
        if isinstance(leaf, AttentionProbs):
            return narrow_probs(leaf, group.rows)
        return self._narrow_tensor(leaf, group, layout)

    def _narrow_tensor(self, tensor: torch.Tensor, group: PackedGroup, layout: Layout) -> torch.Tensor:
        dim = self._packed_dim(tensor, layout)
        if dim is None:
            return tensor
        if dim == 2:  # head-first: narrow the token-first view, hand back head-first
            return self._narrow_token_first(tensor.transpose(1, 2), group, layout).transpose(1, 2)
        return self._narrow_token_first(tensor, group, layout)

    def _narrow_token_first(self, tensor: torch.Tensor, group: PackedGroup, layout: Layout) -> torch.Tensor:
        if layout is Layout.ROWS:
            if group.is_single:
                view = tensor.narrow(0, group.rows[0], 1)
                view._nnsight_batch = True
                return view
            return tensor[torch.tensor(group.rows, device=tensor.device)]  # [k, ...] a copy
        spans = self._spans(layout, group)
        if group.is_single:
            start, length = spans[0]
            view = tensor.narrow(1, start, length)
            view._nnsight_batch = True
            return view
        return _gather_left_padded(tensor, spans)

    def scatter_back(self, full: Any, group: PackedGroup, served: Any) -> None:
        """Write a gathered copy's real tokens back into `full` (a several-request read)."""
        if group is None or group.is_single:
            return
        layout = self.layout_of(self.location)
        for full_leaf, served_tensor in _paired_tensors(full, served):
            if isinstance(full_leaf, AttentionProbs):
                scatter_probs(full_leaf, group.rows, served_tensor)
            elif self._is_packed(full_leaf, layout) and served_tensor is not full_leaf:
                self._write(full_leaf, group, layout, served_tensor)

    # ---- writes ---------------------------------------------------------------------------
    def widen(self, full: Any, group: Any, edited: Any) -> Any:
        if group is None:
            return edited
        layout = self.layout_of(self.location)
        return self._merge(full, edited, lambda f, e: self._widen_leaf(f, group, e, layout))

    def _widen_leaf(self, full: torch.Tensor | AttentionProbs, group: PackedGroup, edited: Any, layout: Layout) -> Any:
        if isinstance(full, AttentionProbs):
            return self._widen_probs(full, group, edited)
        return self._widen_tensor(full, group, edited, layout)

    def _merge(self, full: Any, edited: Any, fn) -> Any:
        if isinstance(full, (torch.Tensor, AttentionProbs)):
            return fn(full, edited)
        if isinstance(full, (list, tuple)) and isinstance(edited, (list, tuple)) and len(full) == len(edited):
            merged = [self._merge(f, e, fn) for f, e in zip(full, edited)]
            if isinstance(full, tuple) and hasattr(full, "_fields"):
                return type(full)(*merged)
            return type(full)(merged)
        if isinstance(full, dict) and isinstance(edited, dict):
            merged = full.copy()
            for key in full:
                if key in edited:
                    merged[key] = self._merge(full[key], edited[key], fn)
            return merged
        if edited is not full and not _same_value(full, edited):
            raise InvalidWriteError(
                f"{_module_of(self.location)}: cannot replace {type(full).__name__} {full!r:.40} with "
                f"{type(edited).__name__} {edited!r:.40}: it is not a per-token value of this request (every "
                "request in the step shares it), so one trace cannot change it"
            )
        return full

    def _widen_tensor(self, full: torch.Tensor, group: PackedGroup, edited: Any, layout: Layout) -> Any:
        if not self._is_packed(full, layout):
            if edited is full:
                return full
            raise InvalidWriteError(
                f"{_module_of(self.location)}: cannot assign here: this tensor of shape {tuple(full.shape)} is "
                "not per token or per request (every request in the step shares it), so one trace cannot change it"
            )
        expected = self._served_shape(full, group, layout)
        edited = self._checked_write(full, edited, expected)
        updated = full.clone()  # the model continues from a new tensor; reads saved before keep their values
        self._write(updated, group, layout, edited)
        return updated

    def _widen_probs(self, full: AttentionProbs, group: PackedGroup, edited: Any) -> AttentionProbs:
        """An assignment to attention probabilities: kept for later reads, as on HF, where the attention
        output has been computed already, so nothing downstream changes."""
        if edited is None:
            return full.replaced({row: None for row in group.rows})
        served = narrow_probs(full, group.rows)
        if served is None:
            raise InvalidWriteError(f"{_module_of(self.location)}: cannot assign attention probabilities to a "
                                    "request that did not ask for them (pass output_attentions=True)")
        edited = self._checked_write(served, edited, tuple(served.shape))
        if group.is_single:
            return full.replaced({group.rows[0]: edited})
        return full.replaced(unpadded_probs(full, group.rows, edited))

    def _checked_write(self, full: torch.Tensor, edited: Any, expected: tuple[int, ...]) -> torch.Tensor:
        """`edited` as a tensor the step can take in place of this request's part of `full`, or an error."""
        where = _module_of(self.location)
        if isinstance(edited, bool) or not isinstance(edited, (torch.Tensor, int, float)):
            raise InvalidWriteError(f"{where}: cannot assign {type(edited).__name__} {edited!r:.40}; assign a "
                                    f"tensor of shape {expected} (or a number)")
        if not isinstance(edited, torch.Tensor):
            edited = torch.as_tensor(edited, dtype=full.dtype, device=full.device).expand(expected)
        if edited.is_meta:
            raise InvalidWriteError(f"{where}: cannot assign a meta tensor (it has a shape but no values)")
        if tuple(edited.shape) != expected:
            raise ShapeMismatchError(
                f"{where}: cannot assign a value of shape {tuple(edited.shape)} where the model has shape {expected}"
            )
        if self.location == SAMPLES_LOCATION:
            check_token_ids(edited, self.vocab_size, where)
        elif self.location == LOGITS_LOCATION and edited.is_floating_point() and bool(edited.isnan().any()):
            raise InvalidWriteError(f"{where}: cannot assign logits containing NaN (use -inf to rule a token out)")
        return edited

    def _served_lead(self, group: PackedGroup, layout: Layout) -> tuple[int, ...]:
        """The leading dims a group is served: `(k,)` rows, or `(k, T_max)` positions."""
        if layout is Layout.ROWS:
            return (len(group.rows),)
        return (len(group.rows), max(length for _, length in self._spans(layout, group)))

    def _served_shape(self, full: torch.Tensor, group: PackedGroup, layout: Layout) -> tuple[int, ...]:
        lead = self._served_lead(group, layout)
        if self._packed_dim(full, layout) == 2:  # head-first: [k, heads, T_max, ...]
            return (lead[0], full.shape[1], lead[1], *full.shape[3:])
        return (*lead, *full.shape[1 if layout is Layout.ROWS else 2 :])

    def _write(self, full: torch.Tensor, group: PackedGroup, layout: Layout, edited: torch.Tensor) -> None:
        edited = edited.to(dtype=full.dtype, device=full.device)
        if self._packed_dim(full, layout) == 2:  # head-first: write through token-first views of both
            full, edited = full.transpose(1, 2), edited.transpose(1, 2)
        if layout is Layout.ROWS:
            for i, row in enumerate(group.rows):
                full[row].copy_(edited[i])
            return
        max_len = edited.shape[1]
        for i, (start, length) in enumerate(self._spans(layout, group)):
            target = full[0, start : start + length]
            source = edited[i, max_len - length :]
            if not _same_memory(target, source):
                target.copy_(source)

    # ---- skip -----------------------------------------------------------------------------
    def gather_skip(self, running: Any, group: Any, replacement: Any) -> Any:
        """Collect one mediator's replacement for a module it skips (checked against its span)."""
        layout = self.layout_of(self.location)
        expected = self._served_lead(group, layout)
        first = next(iter(_tensors(replacement)), None)  # the module's main output (hidden states)
        if first is None or first.is_meta:
            raise InvalidWriteError(f"{_module_of(self.location)}: a skip replacement must hold a tensor with "
                                    f"values, got {type(replacement).__name__} {replacement!r:.40}")
        if tuple(first.shape[: len(expected)]) != expected:
            raise ShapeMismatchError(
                f"{_module_of(self.location)}: a skip replacement of shape {tuple(first.shape)} does not "
                f"cover this request's tokens {expected}"
            )
        if not isinstance(running, _SkipParts):
            running = _SkipParts(self.location)
        running.parts.append((group, replacement))
        return running

    def assemble_skip(self, running: Any) -> Any:
        """The module's whole output if the skips cover every token; else run it and splice them in."""
        if not isinstance(running, _SkipParts):
            return running
        layout = self.layout_of(running.location)
        size = self.num_tokens if layout is Layout.TOKENS else self.num_logits
        covered = sum(length for group, _ in running.parts for _, length in self._spans(layout, group))
        if covered == size:
            return self._concat_skips(running.parts, layout)
        output_location = running.location[: -len(".skip")] + ".output"
        self.pending_skips[output_location] = running
        return NO_SKIP

    def _concat_skips(self, parts: list, layout: Layout) -> Any:
        pieces = []  # (start, [1, length, ...] structure)
        for group, replacement in parts:
            spans = self._spans(layout, group)
            max_len = max(length for _, length in spans)
            for i, (start, length) in enumerate(spans):
                pieces.append((start, apply(replacement, lambda t: t[i : i + 1, max_len - length :]
                                            if t.dim() >= 2 else t, torch.Tensor)))
        pieces.sort(key=lambda piece: piece[0])
        return _concat_dim1([piece for _, piece in pieces])

    def splice_skips(self, location: str, value: Any) -> Any:
        """At a module's output: put the replacements of the requests that skipped it in place."""
        running = self.pending_skips.pop(location, None)
        if running is None:
            return value
        saved, self.location = self.location, location
        try:
            for group, replacement in running.parts:
                value = self.widen(value, group, replacement)
        finally:
            self.location = saved
        return value


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


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a plain truth value
        return False


def _gather_left_padded(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    max_len = max(length for _, length in spans)
    out = tensor.new_zeros((len(spans), max_len, *tensor.shape[2:]))  # [k, T_max, ...]
    for i, (start, length) in enumerate(spans):
        out[i, max_len - length :] = tensor[0, start : start + length]
    return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply(value, found.append, torch.Tensor)
    return found


def _paired_tensors(full: Any, served: Any) -> list[tuple[torch.Tensor | AttentionProbs, Any]]:
    if isinstance(full, (torch.Tensor, AttentionProbs)):
        return [(full, served)] if isinstance(served, torch.Tensor) else []
    if isinstance(full, (list, tuple)) and isinstance(served, (list, tuple)):
        return [pair for f, s in zip(full, served) for pair in _paired_tensors(f, s)]
    if isinstance(full, dict) and isinstance(served, dict):
        return [pair for key in full if key in served for pair in _paired_tensors(full[key], served[key])]
    return []


def _concat_dim1(structures: list) -> Any:
    first = structures[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(structures, dim=1) if first.dim() >= 2 else first
    if isinstance(first, (list, tuple)):
        return type(first)(_concat_dim1([s[i] for s in structures]) for i in range(len(first)))
    if isinstance(first, dict):
        return {key: _concat_dim1([s[key] for s in structures]) for key in first}
    return first


def _module_of(location: str) -> str:
    for suffix in (".output", ".input", ".skip"):
        if location.endswith(suffix):
            return location[: -len(suffix)]
    return location
