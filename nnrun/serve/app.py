"""The FastAPI app: one engine, the nnsight routes, the OpenAI routes, `/health`.

Routes never run model code on the event loop: what they share, and how they wait on the worker
threads, is `ServeState` (nnrun/serve/state.py).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from nnrun.serve.config import ServeConfig
from nnrun.serve.drain import Drain
from nnrun.serve.limits import Guard
from nnrun.serve.state import ServeState

logger = logging.getLogger("nnrun.serve")


def _load_anyio_backend() -> None:
    """Import anyio's asyncio backend without nnsight's `.save` on every object.

    anyio declares classes (`TypedAttributeSet`) that refuse any unannotated public attribute,
    `object.save` included, and it imports that backend lazily, on the first request that asks
    whether its client disconnected: by then nnsight has mounted `.save`, and the import fails.
    """
    if "anyio._backends._asyncio" in sys.modules:
        return
    if not hasattr(object, "save"):
        importlib.import_module("anyio._backends._asyncio")
        return
    from nnsight import save

    from interleaver.nnsight_private import mount_save, unmount_save

    unmount_save("save")
    try:
        importlib.import_module("anyio._backends._asyncio")
    finally:
        mount_save(save, "save")


_load_anyio_backend()


def create_app(config: ServeConfig, model: Any, drain: Drain | None = None) -> ASGIApp:
    """The server's ASGI app over a loaded `ServedLanguageModel` (its engine shuts down with the app).

    `Guard` (auth, the in-flight cap) wraps everything; the trace route (`TraceRoute`) is served
    ahead of FastAPI, which has the rest: `/health`, registration, the OpenAI routes, the lifespan.
    """
    from nnrun.serve import openai_routes, trace_route

    state = ServeState(config, model, drain)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn has drained the requests in flight by now (SIGTERM's graceful shutdown).
        await asyncio.get_running_loop().run_in_executor(None, state.shutdown)

    app = FastAPI(title="nnrun serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.get("/health")
    async def health() -> dict:
        model = state.ready_model()
        return {"status": "ok", "model": config.served_model_name, **model.stats()}

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": invalid_fields_message(error.errors())}, status_code=400)

    app.include_router(trace_route.router)
    app.include_router(openai_routes.router)
    return Guard(
        trace_route.TraceRoute(app, state),
        api_key=config.api_key,
        max_in_flight=config.max_in_flight,
        max_body_bytes=config.max_body_bytes,
        body_timeout_s=config.body_timeout_s,
    )


def invalid_fields_message(errors: Any) -> str:
    """A request's invalid fields, each named with why (pydantic's errors, without its noise)."""
    parts = []
    for error in errors:
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        name = ".".join(location) or "body"
        parts.append(f"{name}: {error.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)
