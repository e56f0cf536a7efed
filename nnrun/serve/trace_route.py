"""The nnsight routes: run a serialized trace, install and clear registered edits.

`run_trace` is what a worker thread does for `POST /v1/nnsight/generate`: rebuild the trace on
the server's model (`payload.load_trace`), run it as a local trace runs (`NNrunTracer.execute`,
inside the trace scope nnsight's `Tracer.__exit__` opens), and collect the names it saved. Every
failure, from garbage bytes to an exception in the block, comes back in the body as the trace's
deferred error with status 200, as nnsight's server does: HTTP errors are for the transport
(auth, limits, a server not ready).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, HTTPException, Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from nnsight.tracing.tracer import dec, inc

from interleaver.nnsight_private import saved_value_ids
from nnrun.serve.engine_model import RequestLimits, ServedLanguageModel
from nnrun.serve.limits import read_asgi_body, read_body
from nnrun.serve.payload import PayloadError, ServerTrace, load_trace
from nnrun.serve.wire import RAW_TENSORS, RESULT_FORMAT_HEADER, capture_error, encode_result

logger = logging.getLogger("nnrun.serve")
router = APIRouter()


def run_trace(model: ServedLanguageModel, blob: bytes, limits: RequestLimits, raw_tensors: bool = False) -> bytes:
    """Run one serialized trace to completion on this (worker) thread; the answer's body.

    `raw_tensors`: the client reads `wire.encode_result`'s faster form (nnrun's client does).
    """
    trace: ServerTrace | None = None
    saves: dict[str, Any] = {}
    error = None
    try:
        trace = load_trace(blob, model)
        saves = _execute(model, trace, limits)
    except BaseException as raised:  # the block's own error, a payload that does not load, a timeout
        if trace is None:
            error = capture_error(raised)
        else:
            error = capture_error(raised, trace.filename, trace.client_filename)
    try:
        registered = [limits.registered_saves.get(request_id, {}) for request_id in limits.request_ids]
        return encode_result(saves, error, registered, raw_tensors)
    finally:
        if trace is not None:
            trace.release()  # after the traceback was formatted from the block's source


def _execute(model: ServedLanguageModel, trace: ServerTrace, limits: RequestLimits) -> dict[str, Any]:
    """`tracer.execute` inside a trace scope; returns the names the trace saved, even if it raised."""
    frame = trace.frame
    inc()  # what Tracer.__exit__ does around a local trace: `.save()` in the trace body needs it
    try:
        with model.for_request(limits, trace.prompt_ids):
            trace.tracer.execute(trace.tracer.info.code)
    finally:
        saved = saved_value_ids()
        saves = {name: value for name, value in frame.f_locals.items() if id(value) in saved}
        dec()  # back at depth 0, this thread's saved set is cleared
    return saves


GENERATE_PATH = "/v1/nnsight/generate"


class TraceRoute:
    """ASGI: `POST /v1/nnsight/generate` served here, every other request passed on to `app` (FastAPI).

    Every notebook's trace takes this route, so it is plain ASGI, without FastAPI's middleware
    stack, router or request objects: on a server whose clients all share one GIL, those cost
    about half of the event loop's time per trace, CPU the engine does not get. `Guard` (auth,
    the in-flight cap) still wraps it.
    """

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != GENERATE_PATH:
            await self.app(scope, receive, send)
            return
        try:
            if scope["method"] != "POST":
                raise HTTPException(status_code=405, detail="Method Not Allowed", headers={"Allow": "POST"})
            body = await generate(self.state, scope, receive)
        except HTTPException as error:
            await JSONResponse({"detail": error.detail}, status_code=error.status_code, headers=error.headers)(
                scope, receive, send
            )
            return
        except ClientDisconnect:
            return  # nobody is left to answer
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/octet-stream"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def generate(state: Any, scope: Scope, receive: Receive) -> bytes:
    """Run a serialized nnsight trace; the answer's body (`wire.encode_result`)."""
    model = state.ready_model()
    headers = dict(scope["headers"])  # ASGI header names are lower-case bytes
    content_length = headers.get(b"content-length")
    blob = await read_asgi_body(
        receive, content_length.decode("latin-1") if content_length is not None else None, state.config.max_body_bytes
    )
    edits = parse_qs(scope["query_string"].decode("latin-1")).get("edits")
    limits = RequestLimits(state.config.request_timeout_s, state.config.block_timeout_s, edits=edits, drain=state.drain)
    raw_tensors = headers.get(RESULT_FORMAT_HEADER.encode()) == RAW_TENSORS.encode()
    work = asyncio.get_running_loop().run_in_executor(state.executor, run_trace, model, blob, limits, raw_tensors)
    return await state.wait_or_cancel(ClientWatch(receive), work, limits.cancelled)


class ClientWatch:
    """Whether the client of a request whose body was read has gone: its next ASGI message says so."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = False

    async def is_disconnected(self) -> bool:
        """Starlette's `Request.is_disconnected`: a receive that may not wait (cancelled before it can)."""
        if not self.gone:
            task = asyncio.ensure_future(self.receive())
            await asyncio.sleep(0)  # one pass of the loop: a disconnect already seen is delivered now
            if task.done():
                self.gone = task.result().get("type") == "http.disconnect"
            else:
                task.cancel()
        return self.gone


@router.post("/v1/nnsight/register/{registration_id}")
async def register(registration_id: str, request: Request, name: str | None = None) -> dict:
    """Install a block (nnsight's serialized edit) that runs for every request from now on."""
    state = request.app.state.serve
    model = state.ready_model()
    payload = await read_body(request, state.config.max_body_bytes)
    try:
        await asyncio.get_running_loop().run_in_executor(
            state.executor, model.registry.register, registration_id, payload, name, model
        )
    except PayloadError as error:
        raise HTTPException(status_code=400, detail=str(error)) from None
    logger.info("installed edit %s%s", registration_id, f" ({name})" if name else "")
    return {"status": "ok", "id": registration_id, "name": name}


@router.get("/v1/nnsight/register/{registration_id}")
async def registration_status(registration_id: str, request: Request) -> dict:
    """Whether an edit is installed, or was taken off because it failed (and why)."""
    return request.app.state.serve.ready_model().registry.status(registration_id)


@router.post("/v1/nnsight/register/{registration_id}/clear")
async def clear_registration(registration_id: str, request: Request) -> dict:
    """Stop running one installed block (clearing an unknown id is a no-op); "error" says if it had failed."""
    registry = request.app.state.serve.ready_model().registry
    error = registry.status(registration_id)["error"]
    registry.clear(registration_id)
    return {"status": "ok", "id": registration_id, "error": error}


@router.post("/v1/nnsight/clear")
async def clear_all(request: Request) -> dict:
    """Stop running every installed block."""
    state = request.app.state.serve
    cleared = state.ready_model().registry.clear()
    return {"status": "ok", "cleared": cleared}
