"""What every route of the server shares (`ServeState`): the config, the model, the worker threads, the drain.

Routes never run model code on the event loop: a trace runs on a worker thread of
`ServeState.executor` (it waits there for the engine thread), and the route awaits it while
watching for the client to disconnect (`wait_or_cancel`), which aborts the trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import HTTPException

from nnrun.serve.config import ServeConfig
from nnrun.serve.drain import Drain

logger = logging.getLogger("nnrun.serve")
DISCONNECT_POLL_S = 0.25  # how often a waiting route looks for its client having gone


class ServeState:
    """What every route shares: the config, the model, the worker threads."""

    def __init__(self, config: ServeConfig, model: Any, drain: Drain | None = None) -> None:
        self.config = config
        self.model = model
        self.drain = drain if drain is not None else Drain()
        # A request in flight holds at most two workers at once (a completion: submitting, then waiting for its
        # choices; a stream's choices are followed on threads of their own); the Guard's cap keeps them within this pool.
        self.executor = ThreadPoolExecutor(max_workers=2 * config.max_in_flight, thread_name_prefix="nnrun-serve")
        self.is_stopping = False

    def ready_model(self) -> Any:
        """The engine's model, or 503 while the server shuts down."""
        if self.model is None or self.is_stopping:
            raise HTTPException(status_code=503, detail="the engine is not serving (starting or shutting down)")
        failure = self.model.engine.runner.failure()
        if failure is not None:
            raise HTTPException(status_code=503, detail=f"the engine cannot run steps any more: {failure}")
        return self.model

    def check_deadlines(self, deadline: float) -> None:
        """504 past a request's own deadline (monotonic); 503 once a drain cuts the requests still running."""
        if time.monotonic() > deadline:
            raise HTTPException(status_code=504, detail="the request ran past this server's time limit")
        if self.drain.is_cut():
            raise HTTPException(status_code=503, detail=str(self.drain.error()))

    async def wait_or_cancel(self, request: Any, work: asyncio.Future, cancelled: Any) -> Any:
        """Await a worker's result; if the client disconnects first, tell the worker to abort, then wait.

        `request`: what says whether the client went away (`is_disconnected()`), a Starlette request
        or the trace route's `ClientWatch`.
        """
        while True:
            done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
            if done:
                return work.result()
            if await request.is_disconnected():
                cancelled.set()
                logger.info("client disconnected; aborting its request")
                return await work

    def shutdown(self) -> None:
        """Stop the engine first (requests still in it fail, so the workers waiting on them return), then them."""
        self.is_stopping = True
        if self.model is not None:
            self.model.shutdown()
        self.executor.shutdown(wait=True, cancel_futures=True)
