"""PackedBatcher: scope an intervention to its own requests inside one flat packed batch.

nnsight's base Batcher gives each invoke a fixed row range of a dim-0 stack. nnrun runs the HF
module tree on one flat batch that packs every scheduled request's new tokens, and the runner
gives each mediator its places in the step's layouts every step (interleaver/layouts.py). Within
a layout, a tensor whose leading dims are the packed ones (`[1, N]`, `[1, R]`, `[B]`) is sliced;
anything else (a mask, a cache object, `logits_to_keep`) is not per-token and passes whole.

A one-request group reading a token-first tensor is served a view of its own rows, so in-place edits
land in the flat tensor: the visit's first such read splits the flat tensor once by the step's spans
(`_request_views`), and every other block waiting on that visit takes its request's view by row; a
saved read is copied at the end of the step (`interleaver/saved_copies.py`), so it pins nothing of the
step. Under autograd the view is narrowed on its own and marked `_nnsight_batch`, so `.grad` redirects
to the tensor in the graph. A several-request group
(a list invoke, an empty invoke) is served a gathered copy, left-padded as HF pads a batch
(`[k, T_max, ...]`); `scatter_back` writes its real tokens back after the mediator moves on.
Assignments (`widen`) never write into the flat tensor in place: the model continues from a new
tensor, so values saved earlier keep what they were, exactly as nnsight on HF behaves.

An attention module's second output is not token-packed: it is an `AttentionProbs` (per batch row,
the probabilities of the requests that passed `output_attentions=True`), served per request by the
helpers in interleaver/attentions.py. Skips live in interleaver/skips.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nnsight.intervention.batching import Batcher
from nnsight.intervention.source import NO_SKIP
from nnsight.util import apply

from interleaver.attentions import narrow_probs, scatter_probs, unpadded_probs
from interleaver.layouts import Layout, PackedGroup, layout_of, module_of
from interleaver.nested import LEAF_TYPES, merge_edited, paired_tensors
from interleaver.skips import SkipSplicing
from interleaver.write_checks import AmbiguousLayoutError, InvalidWriteError, ShapeMismatchError, checked_write
from nnrun.attention.probabilities import AttentionProbs

# What callers import from here: the batcher, a group, the errors a write raises, the skip gate's "run it".
__all__ = ["AmbiguousLayoutError", "InvalidWriteError", "NO_SKIP", "PackedBatcher", "PackedGroup", "ShapeMismatchError"]


class PackedBatcher(SkipSplicing, Batcher):
    """narrow/widen/skip over nnrun's packed step, by the spans the runner computed."""

    def __init__(self, lm_head_path: str | None) -> None:
        super().__init__(envoy=None)
        self.lm_head_prefix = None if lm_head_path is None else lm_head_path + "."
        self.num_tokens = 0  # N
        self.num_logits = 0  # R
        self.num_rows = 0  # B
        self.vocab_size: int | None = None  # the range `model.samples` may be set to (set by the runner)
        self.location = ""  # the location being served now (set by the interleaver)
        self.pending_skips = {}
        # The group of the block that called a module itself (`hook=True`) while that call is served:
        # its values are laid out as that block was served, not as the packed step.
        self.called_by: PackedGroup | None = None
        self._layouts: dict[str, Layout] = {}  # location -> its layout (`layout_of`)
        self.span_lens: dict[Layout, list[int]] | None = None  # per layout, each request's span length
        self.forget_views()

    def set_step(
        self,
        num_tokens: int,
        num_logits: int,
        num_rows: int,
        token_lens: list[int] | None = None,
        logit_lens: list[int] | None = None,
    ) -> None:
        """The step's sizes; each request's number of tokens and of logit positions, in batch order, if known.

        Without the lengths, every read is narrowed on its own (`_request_views` needs them).
        """
        self.num_tokens, self.num_logits, self.num_rows = num_tokens, num_logits, num_rows
        self.span_lens = None if token_lens is None else {Layout.TOKENS: token_lens, Layout.LOGITS: logit_lens}
        self.pending_skips = {}
        self.forget_views()

    def forget_views(self) -> None:
        """End of a visit: the per-request views of its value (`_request_views`) go."""
        # (the value this visit split, its per-request views): read by `PackedMediator.handle` for each one-request read
        self.split_views: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def _request_views(self, tensor: torch.Tensor, layout: Layout) -> list[torch.Tensor] | None:
        """Every request's `[1, T_i, ...]` view of a token-first `[1, N, ...]` value, made by one split per visit.

        The first one-request read of a visit splits the value once; every other block waiting on it
        takes its request's view by row. Only without autograd: with it, a view carries its own
        gradient plumbing (`_mark_for_grads`).
        """
        if self.span_lens is None or torch.is_grad_enabled():
            return None
        views = self.split_views
        if views is None or views[0] is not tensor:
            views = self.split_views = (tensor, tensor.split(self.span_lens[layout], dim=1))
        return views[1]

    @property
    def batching(self) -> bool:
        return True  # other requests always share the step

    # ---- layouts --------------------------------------------------------------------------
    def layout_of(self, location: str) -> Layout:
        layout = self._layouts.get(location)
        if layout is None:  # a location's layout never changes: worked out once
            layout = self._layouts[location] = layout_of(location, self.lm_head_prefix)
        return layout

    def _packed_dim(self, tensor: torch.Tensor, layout: Layout) -> int | None:
        """The dim that holds the step's tokens (0 for rows), or None for a value every request shares.

        Inside a module's `.source`, attention's operations hold head-first `[1, heads, N, head_dim]`
        values (after `.transpose(1, 2)`): their tokens are dim 2. Where dims 1 and 2 both have the
        step's size, nothing says which holds the tokens, so such a read is refused rather than guessed.
        A module's `[N, ...]` value is the step's tokens flattened (dim 0): HF's MoE blocks hand their
        router and experts `hidden_states.view(-1, hidden)`, and their router logits are `[N, experts]`.
        """
        if layout is Layout.ROWS:
            return 0 if tensor.dim() >= 1 and tensor.shape[0] == self.num_rows else None
        size = self.num_tokens if layout is Layout.TOKENS else self.num_logits
        if tensor.dim() >= 2 and tensor.shape[0] == size > 1 and ".source." not in self.location:
            return FLAT_TOKENS_DIM
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
                f"{module_of(self.location)}: cannot tell which dim of this {tuple(tensor.shape)} value holds the "
                f"step's {size} tokens (dims 1 and 2 both have that size) while other requests share the step; read "
                "the value where it is token-first (e.g. the projection's output) instead"
            )
        return 1 if token_first else 2 if head_first else None

    def served_lead(self, group: PackedGroup, layout: Layout) -> tuple[int, ...]:
        """The leading dims a group is served: `(k,)` rows, or `(k, T_max)` positions."""
        if layout is Layout.ROWS:
            return (len(group.rows),)
        return (len(group.rows), max(length for _, length in group.spans(layout)))

    def _served_shape(self, full: torch.Tensor, group: PackedGroup, layout: Layout) -> tuple[int, ...]:
        dim = self._packed_dim(full, layout)
        if layout is not Layout.ROWS and dim == FLAT_TOKENS_DIM:
            return (sum(length for _, length in group.spans(layout)), *full.shape[1:])  # [T, ...] or [sum T_i, ...]
        lead = self.served_lead(group, layout)
        if dim == 2:  # head-first: [k, heads, T_max, ...]
            return (lead[0], full.shape[1], lead[1], *full.shape[3:])
        return (*lead, *full.shape[1 if layout is Layout.ROWS else 2 :])

    # ---- reads ----------------------------------------------------------------------------
    @contextmanager
    def serving_call_by(self, group: PackedGroup | None) -> Iterator[None]:
        """Serve the module call a block makes itself with `group`'s layout (the block's own)."""
        saved, self.called_by = self.called_by, group
        try:
            yield
        finally:
            self.called_by = saved

    def narrow(self, value: Any, group: Any) -> Any:
        if group is None:
            return value
        views = self.split_views
        if (
            views is not None
            and views[0] is value
            and len(group.rows) == 1
            and self.called_by is None
            and not torch.is_grad_enabled()
        ):
            # Another one-request read of the value this visit split already (`_request_views`): its view by row.
            return views[1][group.rows[0]]
        if self.called_by is not None:
            return self._narrow_called(value, group, self.called_by)
        layout = self.layout_of(self.location)
        if isinstance(value, torch.Tensor):  # the common case (a module's hidden states): no tree walk
            return self._narrow_tensor(value, group, layout)
        return apply(value, lambda leaf: self._narrow_leaf(leaf, group, layout), LEAF_TYPES)

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
        if dim == FLAT_TOKENS_DIM and layout is not Layout.ROWS:
            return _narrow_flat(tensor, group.spans(layout))
        return self._narrow_token_first(tensor, group, layout)

    def _narrow_token_first(self, tensor: torch.Tensor, group: PackedGroup, layout: Layout) -> torch.Tensor:
        if layout is Layout.ROWS:
            if group.is_single:
                return _mark_for_grads(tensor.narrow(0, group.rows[0], 1))
            view = _adjacent_rows_view(tensor, group.rows)
            if view is not None:
                return view
            return tensor[torch.tensor(group.rows, device=tensor.device)]  # [k, ...] a copy
        if group.is_single:
            views = self._request_views(tensor, layout)
            if views is not None:
                return views[group.rows[0]]
            start, length = group.spans(layout)[0]
            return _mark_for_grads(tensor.narrow(1, start, length))
        spans = group.spans(layout)
        view = _adjacent_spans_view(tensor, spans)
        if view is not None:
            return view
        return _gather_left_padded(tensor, spans)

    def _narrow_called(self, value: Any, group: PackedGroup, caller: PackedGroup) -> Any:
        """A reader's rows of a module call made by a block (`caller`): values laid out `[k, T_max, ...]`,
        left-padded, over the caller's requests. A reader whose requests the caller's call did not
        cover has no values in it, so the read is refused instead of handing it other requests' rows."""
        if group.rows == caller.rows:
            return value
        if not set(group.rows) <= set(caller.rows):
            raise InvalidWriteError(
                f"{module_of(self.location)}: this call of the module was made by another invoke's block (`hook=True`) "
                "over prompts this invoke is not part of, so it holds none of this invoke's values (nnsight on HF "
                "would hand this invoke the other's values); read the module where this invoke's own prompts reach it"
            )
        layout = self.layout_of(self.location)
        index = [caller.rows.index(row) for row in group.rows]
        caller_len = self.served_lead(caller, layout)[-1]
        reader_len = self.served_lead(group, layout)[-1]

        def rows_of(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() == 0 or tensor.shape[0] != len(caller.rows):
                return tensor  # not laid out by request: every reader sees it whole
            tensor = tensor[index]  # [k_reader, ...]
            if layout is not Layout.ROWS and tensor.dim() >= 2 and tensor.shape[1] == caller_len:
                tensor = tensor[:, caller_len - reader_len :]  # left padding beyond the reader's longest prompt
            return tensor

        return apply(value, rows_of, torch.Tensor)

    def scatter_back(self, full: Any, group: PackedGroup, served: Any) -> None:
        """Write a gathered copy's real tokens back into `full` (a several-request read)."""
        if group is None or group.is_single:
            return
        if isinstance(served, torch.Tensor) and getattr(served, _ADJACENT_VIEW, False):
            return  # a view of `full`: its edits are there already
        layout = self.layout_of(self.location)
        for full_leaf, served_tensor in paired_tensors(full, served):
            if isinstance(full_leaf, AttentionProbs):
                scatter_probs(full_leaf, group.rows, served_tensor)
            elif getattr(served_tensor, _ADJACENT_VIEW, False):
                continue
            elif self._packed_dim(full_leaf, layout) is not None and served_tensor is not full_leaf:
                self._write(full_leaf, group, layout, served_tensor)

    # ---- writes ---------------------------------------------------------------------------
    def widen(self, full: Any, group: Any, edited: Any) -> Any:
        if group is None:
            return edited
        layout = self.layout_of(self.location)
        return merge_edited(self.location, full, edited, lambda f, e: self._widen_leaf(f, group, e, layout))

    def _widen_leaf(self, full: torch.Tensor | AttentionProbs, group: PackedGroup, edited: Any, layout: Layout) -> Any:
        if isinstance(full, AttentionProbs):
            return self._widen_probs(full, group, edited)
        return self._widen_tensor(full, group, edited, layout)

    def _widen_tensor(self, full: torch.Tensor, group: PackedGroup, edited: Any, layout: Layout) -> Any:
        if self._packed_dim(full, layout) is None:
            if edited is full:
                return full
            raise InvalidWriteError(
                f"{module_of(self.location)}: cannot assign here: this tensor of shape {tuple(full.shape)} is "
                "not per token or per request (every request in the step shares it), so one trace cannot change it"
            )
        expected = self._served_shape(full, group, layout)
        edited = checked_write(self.location, full, edited, expected, self.vocab_size)
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
            raise InvalidWriteError(
                f"{module_of(self.location)}: cannot assign attention probabilities to a "
                "request that did not ask for them (pass output_attentions=True)"
            )
        edited = checked_write(self.location, served, edited, tuple(served.shape), self.vocab_size)
        if group.is_single:
            return full.replaced({group.rows[0]: edited})
        return full.replaced(unpadded_probs(full, group.rows, edited))

    def _write(self, full: torch.Tensor, group: PackedGroup, layout: Layout, edited: torch.Tensor) -> None:
        edited = edited.to(dtype=full.dtype, device=full.device)
        dim = self._packed_dim(full, layout)
        if dim == 2:  # head-first: write through token-first views of both
            full, edited = full.transpose(1, 2), edited.transpose(1, 2)
        if layout is Layout.ROWS:
            for i, row in enumerate(group.rows):
                full[row].copy_(edited[i])
            return
        if dim == FLAT_TOKENS_DIM:  # the group's rows in order, no padding
            offset = 0
            for start, length in group.spans(layout):
                target, source = full[start : start + length], edited[offset : offset + length]
                if not _same_memory(target, source):
                    target.copy_(source)
                offset += length
            return
        max_len = edited.shape[1]
        for i, (start, length) in enumerate(group.spans(layout)):
            target = full[0, start : start + length]
            source = edited[i, max_len - length :]
            if not _same_memory(target, source):
                target.copy_(source)


# Marks a several-request read served as a view of the flat tensor (`_adjacent_spans_view`): nothing to scatter back.
_ADJACENT_VIEW = "_nnrun_adjacent_view"
FLAT_TOKENS_DIM = 0  # what `_packed_dim` answers for a `[N, ...]` value in a token layout (rows use 0 too)


def _mark_for_grads(view: torch.Tensor) -> torch.Tensor:
    """A one-request view, marked `_nnsight_batch` so `.grad` redirects to the tensor in the graph.

    Only in a step that runs with autograd: elsewhere no view has a gradient, and the mark (an
    attribute, so a `__dict__` on the tensor) would cost every read.
    """
    if torch.is_grad_enabled():
        view._nnsight_batch = True
    return view


def _narrow_flat(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """A group's rows of a flattened `[N, ...]` value, in request order: `[T, ...]`, or `[sum T_i, ...]` for several.

    One request's rows are a view (edits land in place; `.grad` is redirected as for any one-request
    view). Several requests' rows are a view too when they lie adjacent and in order and autograd is
    off, as `_adjacent_spans_view` decides for `[1, N, ...]` values; otherwise a copy that
    `scatter_back` writes back.
    """
    if len(spans) == 1:
        return _mark_for_grads(tensor.narrow(0, *spans[0]))
    is_adjacent = all(
        start == prev_start + prev_length for (prev_start, prev_length), (start, _) in zip(spans, spans[1:])
    )
    if is_adjacent and not torch.is_grad_enabled():
        view = tensor.narrow(0, spans[0][0], sum(length for _, length in spans))
        setattr(view, _ADJACENT_VIEW, True)
        return view
    return torch.cat([tensor.narrow(0, start, length) for start, length in spans])


def _adjacent_spans_view(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor | None:
    """The `[k, L, ...]` read of spans that are adjacent, in order and of one length L, as a view; else None.

    Such spans need no padding, so the view holds exactly what the left-padded gather would copy
    (a decode step of a list invoke: k spans of one token). In-place edits then land in the flat
    tensor directly, as a one-request view's do. Only without autograd: a gathered copy is what
    carries a several-request read's gradients (see interleaver/grads.py).
    """
    if torch.is_grad_enabled():
        return None
    first, length = spans[0]
    for i, (start, span_length) in enumerate(spans):
        if span_length != length or start != first + i * length:
            return None
    tokens = tensor[0].narrow(0, first, len(spans) * length)  # [k * L, ...]
    if not tokens.is_contiguous():  # (a head-first value's token-first view): gather instead
        return None
    view = tokens.view(len(spans), length, *tokens.shape[1:])  # [k, L, ...]
    setattr(view, _ADJACENT_VIEW, True)
    return view


def _adjacent_rows_view(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """The `[k, ...]` read of consecutive rows in order, as a view (without autograd); else None."""
    if torch.is_grad_enabled() or rows != list(range(rows[0], rows[0] + len(rows))):
        return None
    view = tensor.narrow(0, rows[0], len(rows))
    setattr(view, _ADJACENT_VIEW, True)
    return view


def _gather_left_padded(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    max_len = max(length for _, length in spans)
    out = tensor.new_zeros((len(spans), max_len, *tensor.shape[2:]))  # [k, T_max, ...]
    for i, (start, length) in enumerate(spans):
        out[i, max_len - length :] = tensor[0, start : start + length]
    return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape
