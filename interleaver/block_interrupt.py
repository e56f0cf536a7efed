"""Interrupting a block the engine thread is running, from the thread of the trace that owns it.

A block that loops (or just runs long) holds the engine thread, and with it every request. When
its caller gives up (Ctrl-C while waiting on the trace), the request is aborted, but an abort is
only seen between steps, which never come while the block runs. So the caller also raises
`BlockCancelled` inside the block itself, with CPython's asynchronous exception on the engine
thread. That exception lands at the engine thread's next check for pending work (a function
call, a loop's jump back); the bookkeeping here makes sure it is only sent while that block is
the one running, and that one sent too late is taken, and dropped, as the block parks.

An exception is never retracted with `PyThreadState_SetAsyncExc(thread, NULL)`: CPython 3.11
clears the thread's exception but leaves the interpreter's "async exception pending" flag set,
so every later check goes the slow way, and under a trace function (nnsight's `skip_context`
sets one) a Python function's first instruction re-checks that flag forever: the process hangs
in the next garbage collection that calls a weakref callback.
"""

from __future__ import annotations

import ctypes
import threading
from threading import get_ident
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

    def snapshot(self) -> list[Any]:
        """The mediators whose blocks are running now, outermost first (a copy: the engine thread moves on)."""
        with self._lock:
            return list(self._stack)

    def innermost(self) -> Any | None:
        """The mediator whose block is running now on the engine thread, or None between blocks."""
        with self._lock:
            return self._stack[-1] if self._stack else None

    def enter(self, mediator: Any) -> None:
        with self._lock:
            stack = self._stack
            if not stack:  # an outermost block: the thread that runs it (nested ones run on the same)
                self._thread_id = get_ident()
            stack.append(mediator)

    def leave(self, mediator: Any) -> None:
        """The block parked, finished or raised: no interrupt may land after this (safe to call twice)."""
        with self._lock:
            stack = self._stack
            if not stack or stack[-1] is not mediator:
                return
            # Bookkeeping first, popping last: if the exception lands at one of these calls, the
            # caller's handler calls leave() again, which finds the block still there, or gone.
            interrupted = self._interrupted
            sent = bool(interrupted) and id(mediator) in interrupted  # (none sent: the common case)
            if sent:
                interrupted.discard(id(mediator))
            stack.pop()
        if sent:
            try:
                _check_pending()  # one sent but not yet landed (the block parked first) lands here
            except BlockCancelled:
                pass

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


def _check_pending() -> None:
    """Nothing: calling a Python function makes the interpreter check for a pending async exception."""


def _set_async_exception(thread_id: int | None, exception_type: type[BaseException]) -> None:
    if thread_id is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exception_type))
