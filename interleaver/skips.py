"""`.skip()` in a shared step: each request's replacement for a module, spliced into its own tokens.

nnsight's base Batcher requires the skip replacements at a module to tile every row of the batch.
In a packed step the other requests did not ask for a skip, so the replacements are gathered per
mediator (`gather_skip`), and then either cover every token (the module is skipped, its output is
the replacements joined) or the module runs and the replacements are written over its output for
the requests that skipped it (`splice_skips`, at the module's `.output` visit).

A skip wins over a write to the module's inputs, as on nnsight: the body never sees them, so a
rebuilt `.inputs` that nnrun could not splice into the step is void when the block skips the
module next (`throw_unless_skipped`), and refused only if the module is to run on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nnsight.intervention.interleaver import Event, Mediator
from nnsight.intervention.source import NO_SKIP
from nnsight.util import apply

from interleaver.layouts import Layout, PackedGroup, module_of
from interleaver.nested import concat_dim1, tensors_in
from interleaver.write_checks import InvalidWriteError, ShapeMismatchError


@dataclass
class SkipParts:
    """Skip replacements gathered across the mediators at one `.skip` gate."""

    location: str
    parts: list[tuple[PackedGroup, Any]] = field(default_factory=list)


class SkipSplicing:
    """The skip half of `PackedBatcher` (it provides `location`, `layout_of`, `served_lead` and `widen`)."""

    pending_skips: dict[str, SkipParts]  # output location -> replacements to splice in

    def gather_skip(self, running: Any, group: Any, replacement: Any) -> Any:
        """Collect one mediator's replacement for a module it skips (checked against its span)."""
        layout = self.layout_of(self.location)
        expected = self.served_lead(group, layout)
        first = next(iter(tensors_in(replacement)), None)  # the module's main output (hidden states)
        if first is None or first.is_meta:
            raise InvalidWriteError(
                f"{module_of(self.location)}: a skip replacement must hold a tensor with "
                f"values, got {type(replacement).__name__} {replacement!r:.40}"
            )
        if tuple(first.shape[: len(expected)]) != expected:
            raise ShapeMismatchError(
                f"{module_of(self.location)}: a skip replacement of shape {tuple(first.shape)} does not "
                f"cover this request's tokens {expected}"
            )
        if not isinstance(running, SkipParts):
            running = SkipParts(self.location)
        running.parts.append((group, replacement))
        return running

    def assemble_skip(self, running: Any) -> Any:
        """The module's whole output if the skips cover every token; else run it and splice them in."""
        if not isinstance(running, SkipParts):
            return running
        layout = self.layout_of(running.location)
        size = self.num_tokens if layout is Layout.TOKENS else self.num_logits
        covered = sum(length for group, _ in running.parts for _, length in group.spans(layout))
        if covered == size:
            return _concat_skips(running.parts, layout)
        output_location = running.location[: -len(".skip")] + ".output"
        self.pending_skips[output_location] = running
        return NO_SKIP

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


def throw_unless_skipped(mediator: Mediator, provider: str, error: Exception) -> Any:
    """A write at `provider` that could not be spliced in: void if the block's next event skips the
    module (its body never reads the inputs), else raised in the block. Returns the block's next park."""
    if not provider.endswith(".input"):
        return mediator.throw(error)
    pending = mediator.switch()  # the block goes on as if the write were held, up to its next park
    if pending is None:  # the block ended: the module runs on inputs it cannot be given
        raise error
    if pending.event is Event.SKIP and pending.provider == provider[: -len(".input")] + ".skip":
        return pending
    mediator.pending = pending
    return mediator.throw(error)


def _concat_skips(parts: list[tuple[PackedGroup, Any]], layout: Layout) -> Any:
    """The replacements, each request's real tokens cut from its left-padded rows, joined in step order."""
    pieces = []  # (start, [1, length, ...] structure)
    for group, replacement in parts:
        spans = group.spans(layout)
        max_len = max(length for _, length in spans)
        for i, (start, length) in enumerate(spans):
            pieces.append(
                (
                    start,
                    apply(replacement, lambda t: t[i : i + 1, max_len - length :] if t.dim() >= 2 else t, torch.Tensor),
                )
            )
    pieces.sort(key=lambda piece: piece[0])
    return concat_dim1([piece for _, piece in pieces])
