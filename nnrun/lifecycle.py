"""Stopping engines at interpreter exit.

The engine thread is a daemon thread, so CPython does not wait for it. If it is still running when
the interpreter finalizes (finishing the step that completed the last trace, serving a generation
another daemon thread left running, or inside a block that loops), CPython ends it with
`pthread_exit` the next time it takes the GIL. There it is usually inside torch (freeing a tensor
with the GIL released), whose `noexcept` C++ frames turn that forced unwind into `terminate called
without an active exception` (SIGABRT); inside a block, it unwinds a greenlet's stack, which is not
the thread's own, and the process crashes at random. Either way the script loses its exit code.

So at exit every live engine is stopped before finalization begins:

1. requests still in flight are aborted with `InterpreterExiting` (their callers get it), and the
   engine is stopped: it ends its current step, finishes the blocks of its requests on its own
   thread (greenlets die on the thread that runs them) and its thread ends;
2. a thread that has not ended after `STEP_WAIT_S` is inside a block that does not return (or a
   very long step): `InterpreterExiting` is raised in it (CPython's asynchronous exception, which
   lands at its next Python line, never inside a torch op: the block fails, the engine stops as in 1);
3. a block that swallows that too gets `_ParkedAtExit`, whose construction parks the thread in a
   lock wait for good: a thread that never takes the GIL again is never unwound, and the process
   exits normally around it, with its own exit code;
4. daemon threads that were waiting on the aborted requests get `GRACE_S` to finish unwinding
   (they free the saved tensors of their traces: torch work, the same hazard as above).

This runs from `atexit`, i.e. after CPython joined the non-daemon threads: those run to completion
as Python promises, and the engine keeps serving their traces while the interpreter waits for them.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nnrun.engine import LLM

logger = logging.getLogger(__name__)

STEP_WAIT_S = 0.5  # for the engine thread to finish its step and stop before it is interrupted
INTERRUPT_WAIT_S = 1.0  # for an interrupted block to unwind and the engine thread to stop
PARK_WAIT_S = 30.0  # for the thread to park: a torch op in progress must return first
GRACE_S = 1.0  # for daemon callers woken by the aborts to unwind
POLL_S = 0.005


class InterpreterExiting(RuntimeError):
    """What a request still in flight at interpreter exit fails with."""

    def __init__(
        self,
        message: str = "the Python interpreter is exiting: nnrun aborted this request, which was "
        "still running (wait for your traces, or call shutdown(), before the program ends)",
    ) -> None:
        super().__init__(message)


class _ParkedAtExit(BaseException):
    """Raised into an engine thread that would not stop: constructing it parks the thread for good.

    CPython constructs an asynchronous exception in the thread it is raised in, when an `except`
    or `finally` on its way is reached (the engine's own code has several), so even a block that
    swallows every exception parks here.
    """

    def __init__(self, *args: object) -> None:
        _parked_ids.add(threading.get_ident())
        threading.Event().wait()  # a lock wait, GIL released, that nothing ever ends


# The only state here, process-wide as exit hooks are: the engines to stop at exit (weakly held,
# so a dropped idle engine is collected), whether the hook is registered, and the parked threads.
_engines: "weakref.WeakSet[LLM]" = weakref.WeakSet()
_lock = threading.Lock()
_is_registered = False
_parked_ids: set[int] = set()


def _forget_after_fork() -> None:
    """A forked child has none of its parent's engine threads: nothing of theirs to stop there."""
    global _engines, _lock
    _engines, _lock = weakref.WeakSet(), threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def stop_at_exit(engine: LLM) -> None:
    """Have `engine` stopped at interpreter exit unless it is shut down before."""
    global _is_registered
    with _lock:
        _engines.add(engine)
        if not _is_registered:
            atexit.register(_stop_all)
            _is_registered = True


def _stop_all() -> None:
    engines = list(_engines)
    callers = _threads_in_engine_calls(engines)  # before the aborts wake them
    num_aborted = 0
    for engine in engines:
        try:
            num_aborted += _stop(engine)
        except Exception:  # one engine that fails to stop must not leave the others running
            logger.exception("nnrun: stopping an engine at interpreter exit failed")
    if num_aborted:
        deadline = time.monotonic() + GRACE_S
        for thread in callers:
            if thread.daemon:
                thread.join(max(0.0, deadline - time.monotonic()))


def _stop(engine: LLM) -> int:
    """Abort what is in flight, stop the engine, escalate if its thread does not end; the number aborted."""
    deadline = time.monotonic() + STEP_WAIT_S
    request_ids = engine.request_ids_in_flight()
    if request_ids:  # aborted first, so that their callers learn why
        engine.abort(request_ids, InterpreterExiting())
        while engine.num_requests_in_flight and _is_running(engine) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    if engine.shutdown(timeout=max(10 * POLL_S, deadline - time.monotonic())):
        return len(request_ids)
    thread = engine.engine_thread
    for exception_type, wait_s in ((InterpreterExiting, INTERRUPT_WAIT_S), (_ParkedAtExit, PARK_WAIT_S)):
        _raise_in(thread, exception_type)
        deadline = time.monotonic() + wait_s
        while thread.is_alive() and thread.ident not in _parked_ids and time.monotonic() < deadline:
            thread.join(POLL_S)
        if not thread.is_alive():
            return len(request_ids)
        if thread.ident in _parked_ids:
            return 0  # its callers stay blocked, in a lock wait, as the parked thread does
    # Only a C call that has not returned in all this time keeps a thread from both exceptions;
    # if it never returns, the thread never takes the GIL again and is never unwound either.
    return 0


def _is_running(engine: LLM) -> bool:
    thread = engine.engine_thread
    return thread is not None and thread.is_alive()


def _raise_in(thread: threading.Thread, exception_type: type[BaseException]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exception_type))


def _threads_in_engine_calls(engines: list[LLM]) -> list[threading.Thread]:
    """Threads other than this one and the engines' own that are running the engine's or its runner's code."""
    files = [__file__] + [
        getattr(sys.modules.get(type(engine.runner).__module__), "__file__", None) for engine in engines
    ]
    roots = tuple({os.path.join(os.path.dirname(file), "") for file in files if file})
    skip = {threading.get_ident()} | {
        engine.engine_thread.ident for engine in engines if engine.engine_thread is not None
    }
    threads = {thread.ident: thread for thread in threading.enumerate()}
    callers = []
    for ident, frame in sys._current_frames().items():
        if ident in skip or ident not in threads:
            continue
        while frame is not None and not frame.f_code.co_filename.startswith(roots):
            frame = frame.f_back
        if frame is not None:
            callers.append(threads[ident])
    return callers
