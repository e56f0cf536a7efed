"""Stopping the server on SIGTERM: drain, cut what is left with a clear error, exit 0, never hang.

uvicorn stops accepting connections and waits up to `--drain-timeout` for the requests in flight;
past that it cancels their tasks, which cuts a stream without a word and answers a trace with a
bare 500. So the routes cut their own requests a little before (`Drain.is_cut`): a trace gets
`ServerShuttingDown` as its error, a stream an error event. uvicorn then re-raises the signal it
drained on (exit status 143); a supervisor reads that as a failure, so `DrainingServer` does not,
and a drained server exits 0. If anything still holds the process `SHUTDOWN_GRACE_S` after the
drain timeout (a thread that never returns), it exits with status 1 rather than need a SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Generator

import uvicorn

from nnrun.serve.wire import ServerShuttingDown

logger = logging.getLogger("nnrun.serve")
SHUTDOWN_GRACE_S = 5.0  # past the drain timeout, for the engine and the worker threads to stop
FORCED_EXIT_STATUS = 1


class Drain:
    """When requests still running are cut once the server began to stop (None: it is not stopping)."""

    def __init__(self) -> None:
        self.cut_at: float | None = None
        self.timeout_s: float | None = None

    def begin(self, timeout_s: float) -> None:
        # Cut a little before uvicorn's own deadline, so the answers (an error) are sent before it cancels.
        margin = min(1.0, 0.25 * timeout_s)
        self.timeout_s = timeout_s
        self.cut_at = time.monotonic() + timeout_s - margin

    @property
    def is_draining(self) -> bool:
        return self.cut_at is not None

    def is_cut(self) -> bool:
        return self.cut_at is not None and time.monotonic() >= self.cut_at

    def error(self) -> ServerShuttingDown:
        return ServerShuttingDown(
            f"the server is shutting down and this request did not finish within its drain "
            f"timeout of {self.timeout_s:g} s; it was aborted"
        )


class DrainingServer(uvicorn.Server):
    """uvicorn's server that tells the routes it is draining, exits 0 after a drain, and never hangs."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.is_forced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            timeout_s = self.config.timeout_graceful_shutdown or 0.0
            self.drain.begin(timeout_s)
            timer = threading.Timer(timeout_s + SHUTDOWN_GRACE_S, self._force_exit)
            timer.daemon = True  # it must not itself keep the process alive
            timer.start()

    def _force_exit(self) -> None:
        logger.error("nnrun serve did not stop within its drain timeout + %g s; exiting anyway", SHUTDOWN_GRACE_S)
        logging.shutdown()
        os._exit(FORCED_EXIT_STATUS)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, without raising the caught signal again at the end: a drained server exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original: dict[int, Any] = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
