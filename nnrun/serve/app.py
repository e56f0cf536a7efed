"""The FastAPI app: one engine, the nnsight routes, the OpenAI routes, `/health`.

Every refusal on the OpenAI routes, whoever raises it, takes OpenAI's error shape (`openai_errors`).
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
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from nnrun.serve.config import ServeConfig
from nnrun.serve.drain import Drain
from nnrun.serve.limits import Guard
from nnrun.serve.openai_errors import error_response, http_error_response
from nnrun.serve.state import ServeState

logger = logging.getLogger("nnrun.serve")
ROUTES_SERVED = (
    "OpenAI's routes are GET /v1/models, POST /v1/completions and POST /v1/chat/completions; "
    "nnsight's are under /v1/nnsight/"
)


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
        errors = error.errors()
        return error_response(request.url.path, 400, invalid_fields_message(errors), param=invalid_param(errors))

    @app.exception_handler(StarletteHTTPException)
    async def refused(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code in (404, 405) and error.detail in ("Not Found", "Method Not Allowed"):  # the router's
            error.detail = f"{request.method} {request.url.path} is not served here ({error.detail}); {ROUTES_SERVED}"
        return http_error_response(request.url.path, error)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:  # logged by Starlette, then answered
        return error_response(request.url.path, 500, f"the server failed: {type(error).__name__}: {error}")

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
        if error.get("type") == "json_invalid":
            why = error.get("ctx", {}).get("error", "")
            return f"the request body is not valid JSON ({why} at character {error['loc'][-1]})"
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        name = ".".join(location) or "body"
        parts.append(f"{name}: {error.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


# What pydantic names a union's branch in an error's location (`prompt.list[int].0`): not a field.
_BRANCH_NAMES = {"str", "int", "float", "bool", "list", "dict"}


def invalid_param(errors: Any) -> str | None:
    """The field the first error is about, as OpenAI's `param` names it (`messages.0.role`); None for the body."""
    if not errors or errors[0].get("type") == "json_invalid":
        return None
    location = [str(part) for part in errors[0].get("loc", ()) if part != "body"]
    fields = [part for part in location if (part.isidentifier() and part not in _BRANCH_NAMES) or part.isdigit()]
    return ".".join(fields) or None
