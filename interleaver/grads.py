"""`.retain_grad()` on a value a block was served: its `.grad` holds the gradient nnsight gives on HF.

A one-request read is a view of the step's flat tensor (`PackedBatcher.narrow`), and the model
continues from the flat tensor, not from the view: autograd never routes a gradient through the
view, so a retained view's `.grad` stayed None. On HF a one-prompt trace is served the tensor the
model uses, whose `.grad` is the loss's whole gradient with respect to it. So every view served
in a step that runs with autograd gets a `GradSink`: a hook on the flat tensor writes the view's
slice of the flat tensor's gradient into the view's `.grad` if the block retained it.

That slice already holds whatever flowed back through the view itself (a loss computed from the
view), which autograd's own retain hook has also added to `.grad` by then: a hook on the target,
which runs before the retain hook, remembers `.grad` as it was, and the flat tensor's hook sets
it to that plus the slice, so nothing counts twice. At the end of the step a saved view is
replaced by a copy (`requests._unpin`); `carry_grad` moves the sink and the gradient to the copy,
so a backward after the trace (from a saved output) still fills the saved value's `.grad`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from interleaver.nested import paired_tensors

# The tensor's own `.grad` slot: nnsight's backward trace replaces `torch.Tensor.grad` with a
# property that parks the block, and `_grad` reads the slot without the non-leaf warning.
_GRAD_SLOT = torch._C.TensorBase.grad
_READ_GRAD = torch._C.TensorBase._grad
_UNSET = object()


class GradSink:
    """Writes one served view's slice of its flat tensor's gradient into the view's (or its copy's) `.grad`."""

    def __init__(self, view: torch.Tensor, flat: torch.Tensor, dim: int, start: int, length: int) -> None:
        self.target = weakref.ref(view)
        self.slice = (dim, start, length)  # view == flat.narrow(*slice)
        self.retains = False  # the block retained the view before it was replaced by its copy
        self.before: Any = _UNSET  # the target's `.grad` before this backward's retain hook ran
        self.watch(view)
        flat.register_hook(self._on_flat_grad)
        view._nnrun_grad_sink = self

    def watch(self, tensor: torch.Tensor) -> None:
        ref = weakref.ref(tensor)
        tensor.register_hook(lambda grad: self._on_target_grad(ref))

    def retarget(self, copy: torch.Tensor) -> None:
        self.target = weakref.ref(copy)
        copy._nnrun_grad_sink = self
        self.watch(copy)

    def _on_target_grad(self, ref: weakref.ref) -> None:
        tensor = ref()
        if tensor is not None and tensor is self.target() and (self.retains or tensor.retains_grad):
            self.before = _READ_GRAD.__get__(tensor)

    def _on_flat_grad(self, grad: torch.Tensor) -> None:
        target = self.target()
        before, self.before = self.before, _UNSET
        if target is None or not (self.retains or target.retains_grad):
            return
        if before is _UNSET:
            before = _READ_GRAD.__get__(target)
        piece = grad.narrow(*self.slice).detach()
        _GRAD_SLOT.__set__(target, piece.clone() if before is None else before + piece)


def sink_grads(full: Any, served: Any) -> None:
    """Give each one-request view served from `full` that autograd tracks a `GradSink`."""
    for flat, view in paired_tensors(full, served):
        if (
            view is flat
            or not getattr(view, "_nnsight_batch", False)
            or not flat.requires_grad
            or getattr(view, "_nnrun_grad_sink", None) is not None
        ):
            continue
        narrowing = _narrowing(view, flat)
        if narrowing is not None:
            GradSink(view, flat, *narrowing)


def _narrowing(view: torch.Tensor, flat: torch.Tensor) -> tuple[int, int, int] | None:
    """`(dim, start, length)` such that `view` is `flat.narrow(dim, start, length)`, or None."""
    if view.dim() != flat.dim() or view.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
        return None
    dims = [d for d in range(flat.dim()) if view.shape[d] != flat.shape[d]]
    if not dims:
        return 0, 0, flat.shape[0]
    if len(dims) > 1 or flat.stride(dims[0]) == 0:
        return None
    dim = dims[0]
    return dim, (view.storage_offset() - flat.storage_offset()) // flat.stride(dim), view.shape[dim]


def carry_grad(view: torch.Tensor, copy: torch.Tensor) -> None:
    """A saved view is replaced by `copy` at the end of its step: its gradient and sink go with it."""
    sink = getattr(view, "_nnrun_grad_sink", None)
    if sink is None or not copy.requires_grad:
        return
    sink.retains = sink.retains or view.retains_grad
    if sink.retains:  # (reading `.grad` of a non-leaf that is not retained warns)
        copy.retain_grad()
        grad = _READ_GRAD.__get__(view)
        if grad is not None:
            _GRAD_SLOT.__set__(copy, grad)
    sink.retarget(copy)
