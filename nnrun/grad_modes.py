"""Autograd modes for one `with` block, at a fraction of `torch.no_grad()`'s and `torch.inference_mode()`'s cost.

Those two are decorators as well as context managers, and their construction alone costs about a
microsecond: an engine step enters a mode twice, which matters when the whole step is a millisecond.
"""

from __future__ import annotations

import torch


class GradOff:
    """`torch.no_grad()` for one `with` block: the same mode, restored on exit."""

    __slots__ = ("previous",)

    def __enter__(self) -> None:
        self.previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.previous)


class InferenceOn:
    """`torch.inference_mode()` for one `with` block: torch's own guard, without the decorator machinery."""

    __slots__ = ("guard",)

    def __enter__(self) -> None:
        self.guard = torch._C._InferenceMode(True)
        self.guard.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.guard.__exit__(*exc)
