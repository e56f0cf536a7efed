"""A CPU stand-in for CUDA graph capture that keeps a CUDA graph's semantics, for the graph tests.

A CUDA graph records the kernels one call launched, with the addresses they read and wrote, and a
replay relaunches exactly those kernels: Python does not run again, and a tensor the captured
code created or read is the same memory on every replay. `RecordingCapturer` does the same one
level up: it records every aten op of the captured call together with the tensor objects it
touched, and a replay re-runs those ops on those tensors, writing each result into the tensor the
op produced at capture. So a value the code computed in Python at capture time, or a tensor it
made outside the graph's static buffers, stays frozen exactly as it would on a GPU.

It also rejects what cannot be captured on a GPU: reading a tensor's value on the host
(`.item()`, `bool(tensor)`, ...) and ops whose output size depends on the data. While capturing,
`torch.cuda.is_current_stream_capturing()` answers True, as it does on a GPU (transformers skips
its host-side checks then).

Kernels implemented in Python (the FlashInfer emulator) launch through `launch_kernel`: it runs the
kernel now, and a capture records it as one step that re-runs on replay.

On tensor-parallel ranks (tests/tp/test_tp_cuda_graphs.py) it records the collectives too: gloo's
all-reduce is an op like the others, waited for on replay as the captured code waited for it. A
tensor subclass (transformers' DTensor) is not recorded as itself: its Python runs at capture, and
the plain ops and collectives it issues are what replays, as on a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

HOST_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    torch.ops.aten.nonzero.default,  # output size depends on the data
    torch.ops.aten.masked_select.default,
    torch.ops.aten.equal.default,  # returns a Python bool
}


_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


class HostSyncDuringCapture(RuntimeError):
    """The captured code read a device value on the host; a CUDA graph capture would fail here."""


_active_recorder: "_Recorder | None" = None


def launch_kernel(kernel: Callable[[], None]) -> None:
    """Run a Python-implemented kernel; while capturing, record it as one replayable step."""
    if _active_recorder is None:
        kernel()
        return
    with _disable_current_modes():  # the kernel's own ops are its business, not separate steps
        kernel()
    _active_recorder.steps.append(kernel)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Callable[[], None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(cls is not torch.Tensor and not issubclass(torch.Tensor, cls) for cls in types):
            # A tensor subclass (a DTensor on tensor-parallel ranks) runs Python around plain ops: let
            # it, and record the plain ops it issues (they come back here), as a GPU records kernels.
            return NotImplemented
        if func in HOST_SYNC_OPS:
            raise HostSyncDuringCapture(f"{func} reads device data on the host during CUDA graph capture")
        output = func(*args, **kwargs)
        self.steps.append(_replay_step(func, args, kwargs, output))
        return output


def _replay_step(func, args, kwargs, captured_output) -> Callable[[], None]:
    def step() -> None:
        fresh_output = func(*args, **kwargs)
        if func.namespace == "_c10d_functional" and func is not _WAIT_TENSOR:
            # A functional collective's output is ready once waited for; the capture's wait waits
            # for the captured output's collective, not this one.
            for fresh in tree_flatten(fresh_output)[0]:
                if isinstance(fresh, torch.Tensor):
                    _WAIT_TENSOR(fresh)
        for captured, fresh in zip(tree_flatten(captured_output)[0], tree_flatten(fresh_output)[0]):
            if _is_collective_work(fresh):
                # A collective (gloo's all-reduce on CPU tensor-parallel ranks) runs asynchronously:
                # the code that launched it waited on its `Work`, and a GPU graph orders its kernels.
                fresh.wait()
            elif isinstance(captured, torch.Tensor) and not _same_memory(captured, fresh):
                captured.copy_(fresh)

    return step


def _is_collective_work(value: Any) -> bool:
    """A c10d op's `Work` (the dispatcher hands it over as a TorchScript object)."""
    return isinstance(value, torch.ScriptObject) and hasattr(value, "wait")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """In-place ops return their input and views alias it: nothing to copy then."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


@contextmanager
def _stream_capturing() -> Iterator[None]:
    original = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = original


class RecordingCapturer:
    """`GraphCapturer` for CPU tests; `captures` counts the graphs recorded."""

    captures_attention = True  # as CUDA's: the attention kernels are recorded with the rest

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        global _active_recorder
        fn()  # the warm-up run a CUDA capture does first
        recorder = _Recorder()
        _active_recorder = recorder
        try:
            with recorder, _stream_capturing():
                output = fn()
        finally:
            _active_recorder = None
        self.captures += 1

        def replay() -> None:
            self.replays += 1
            with torch.no_grad():  # a GPU replay records no autograd history either
                for step in recorder.steps:
                    step()

        return replay, output
