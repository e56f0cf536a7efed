"""How long a block has held the engine thread, and the watchdog that ends registered edits which hold it too long.

A block runs on the engine thread; while it runs, no step runs, so every request waits. A trace's
own worker thread watches its blocks (`ServedLanguageModel._run_job`). A completion from an
OpenAI route has no such thread, yet a registered edit rides it as a block, so `EditWatchdog`, one
thread per server, watches the edits riding completions: one that runs past the block timeout
without reaching a module is interrupted, its request ended, and the edit taken off the server
with the reason recorded (`Registry.fail`), so the next request does not meet it again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

logger = logging.getLogger("nnrun.serve")
WATCH_POLL_S = 0.05
MAX_KEPT_FAILURES = 256  # reasons kept for routes that have not read them yet (a client that left never does)


class BlockWatch:
    """How long one of some blocks has held the engine thread without parking.

    A block is running if it is the innermost of the engine's running blocks; it has not parked
    since the last look if its `pending` (replaced at every park) is the same object.
    """

    def __init__(self, runner: Any, mediators: list[Any]) -> None:
        self.runner = runner  # the engine's NNsightGPUModelRunner
        self.mediators = mediators
        self.running: Any = None  # the watched block running at the last look, or None
        self._seen: tuple[int, int] | None = None  # (mediator id, pending id) at the last look
        self._since = 0.0

    def seconds_running(self) -> float:
        running = self.runner.running_block()
        if running is None or not any(running is m for m in self.mediators):
            self._seen = self.running = None
            return 0.0
        self.running = running
        seen = (id(running), id(running.pending))
        if seen != self._seen:
            self._seen, self._since = seen, time.monotonic()
        return time.monotonic() - self._since


def registration_of(mediator: Any) -> Any:
    """The `Registration` a registered edit's copy was made from (None for a trace's own block)."""
    return getattr(mediator, "registration", None)


def edit_timeout_message(registration: Any, seconds: float, limit_s: float) -> str:
    label = registration.name or registration.id
    return (
        f"the registered edit {label!r} ran {seconds:.1f} s without reaching the model, over this server's "
        f"limit of {limit_s:g} s per block (a loop?); it was taken off the server and its request aborted"
    )


class EditWatchdog:
    """One thread ending registered edits that hold the engine thread past `block_timeout_s` on completions.

    `watch(request, mediators)` as a completion is queued; finished requests are forgotten on the
    next look. `on_timeout(registration, message)` is told about each edit it ends.
    """

    def __init__(self, engine: Any, block_timeout_s: float, on_timeout: Callable[[Any, str], None]) -> None:
        self.engine = engine
        self.block_timeout_s = block_timeout_s
        self.on_timeout = on_timeout
        self._lock = threading.Lock()
        self._watched: dict[str, tuple[Any, BlockWatch]] = {}  # request id -> (request, its edits' watch)
        self._failures: dict[str, str] = {}  # request id -> why its edit was ended (read once by its route)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def watch(self, request: Any, mediators: list[Any]) -> None:
        watch = BlockWatch(self.engine.runner, mediators)
        with self._lock:
            self._watched[request.request_id] = (request, watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nnrun-serve-edit-watchdog", daemon=True)
                self._thread.start()

    def failure(self, request_id: str) -> str | None:
        """Why this completion's edit was ended, if it was (asked once, by the completion's route)."""
        with self._lock:
            return self._failures.pop(request_id, None)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """End a completion early (its client left, a deadline passed), interrupting its edit if it is running."""
        with self._lock:
            watched = self._watched.pop(request_id, None)
        self.engine.abort([request_id], error)
        if watched is not None:
            self.engine.runner.interrupt_blocks(watched[1].mediators)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stopping.wait(WATCH_POLL_S):
            with self._lock:
                for request_id in [rid for rid, (req, _) in self._watched.items() if req.is_finished]:
                    del self._watched[request_id]
                watched = list(self._watched.items())
            for request_id, (_, watch) in watched:
                seconds = watch.seconds_running()
                if seconds > self.block_timeout_s:
                    self._end(request_id, watch, seconds)

    def _end(self, request_id: str, watch: BlockWatch, seconds: float) -> None:
        registration = registration_of(watch.running)
        message = edit_timeout_message(registration, seconds, self.block_timeout_s)
        with self._lock:
            self._failures[request_id] = message
            while len(self._failures) > MAX_KEPT_FAILURES:
                del self._failures[next(iter(self._failures))]
            self._watched.pop(request_id, None)
        self.engine.abort([request_id], TimeoutError(message))
        self.engine.runner.interrupt_blocks(watch.mediators)
        logger.warning("%s", message)
        self.on_timeout(registration, message)
