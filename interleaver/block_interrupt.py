"""Interrupting a block the engine thread is running, from the thread of the trace that owns it.

A block that loops (or just runs long) holds the engine thread, and with it every request. When
its caller gives up (Ctrl-C while waiting on the trace), the request is aborted, but an abort is
only seen between steps, which never come while the block runs. So the caller also raises
`BlockCancelled` inside the block itself, with CPython's asynchronous exception on the engine
thread. That exception lands at the next bytecode the thread runs; the bookkeeping here makes
sure it can only land while that block is the one running, and is defused when the block parks.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any


class BlockCancelled(BaseException):
    """Raised inside a block whose caller stopped waiting for it (its requests are aborted)."""


class RunningBlocks:
    """Which blocks the engine thread is inside right now (nested when a block calls a module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stack: list[Any] = []  # mediators whose worker is running, innermost last
        self._interrupted: set[int] = set()  # ids of mediators already sent an interrupt (one each)
        self._thread_id: int | None = None

    def enter(self, mediator: Any) -> None:
        with self._lock:
            self._stack.append(mediator)
            self._thread_id = threading.get_ident()

    def leave(self, mediator: Any) -> None:
        """The block parked, finished or raised: no interrupt may land after this (safe to call twice)."""
        with self._lock:
            if self._stack and self._stack[-1] is mediator:
                self._stack.pop()
                if id(mediator) in self._interrupted:
                    _set_async_exception(self._thread_id, None)  # one sent too late is cancelled
                    self._interrupted.discard(id(mediator))

    def interrupt(self, mediators: list[Any]) -> bool:
        """Raise BlockCancelled in the running block if it is one of `mediators`; True if it was."""
        with self._lock:
            if not self._stack:
                return False
            running = self._stack[-1]
            if not any(running is m for m in mediators) or id(running) in self._interrupted:
                return False
            self._interrupted.add(id(running))
            _set_async_exception(self._thread_id, BlockCancelled)
            return True


def _set_async_exception(thread_id: int | None, exception_type: type[BaseException] | None) -> None:
    if thread_id is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                                   ctypes.py_object(exception_type) if exception_type else None)
