"""Auth and limits: the API key (401), the body size (413) and the requests in flight (429).

Keys are compared with `hmac.compare_digest`, which takes the same time however much of a wrong
key matches. The in-flight cap counts HTTP requests being served (running or waiting for the
engine); one past it is refused at once with 429 and a `Retry-After`, rather than queued, so a
client sees back-pressure instead of a timeout. `/health` needs no key and is never refused.
"""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from nnrun.serve.wire import API_KEY_HEADER

OPEN_PATHS = ("/health",)


class Guard:
    """ASGI middleware: the key check and the in-flight cap, around every route but `/health`.

    Plain ASGI rather than a route dependency, so a streamed answer (SSE) counts as in flight
    until its last byte is sent.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_in_flight: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0  # only touched on the event loop's thread

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if not self.is_authorized(Headers(scope=scope)):
            await _refuse(scope, receive, send, 401, "missing or invalid API key", {"WWW-Authenticate": "Bearer"})
            return
        if self.num_in_flight >= self.max_in_flight:
            await _refuse(scope, receive, send, 429, f"this server is serving its limit of {self.max_in_flight} "
                          "requests; retry shortly", {"Retry-After": "1"})
            return
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1

    def is_authorized(self, headers: Headers) -> bool:
        if self.api_key is None:
            return True
        presented = presented_key(headers)
        return presented is not None and hmac.compare_digest(presented.encode(), self.api_key)


def presented_key(headers: Headers) -> str | None:
    """The key a client sent: nnsight's `ndif-api-key` header, or OpenAI's `Authorization: Bearer`."""
    key = headers.get(API_KEY_HEADER)
    if key:
        return key
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def _refuse(scope: Scope, receive: Receive, send: Send, status_code: int, detail: str,
                  headers: dict[str, str]) -> None:
    await JSONResponse({"detail": detail}, status_code=status_code, headers=headers)(scope, receive, send)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it passes `max_bytes` (whatever Content-Length claimed)."""
    return await read_asgi_body(request.receive, request.headers.get("content-length"), max_bytes)


async def read_asgi_body(receive: Receive, content_length: str | None, max_bytes: int) -> bytes:
    """`read_body` from the ASGI messages themselves; `ClientDisconnect` if the client goes first."""
    _check_declared(content_length, max_bytes)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _check_declared(content_length: str | None, max_bytes: int) -> None:
    if content_length is not None and content_length.isdigit() and int(content_length) > max_bytes:
        raise _too_large(max_bytes)


def _too_large(max_bytes: int) -> HTTPException:
    return HTTPException(status_code=413, detail=f"request body over this server's limit of {max_bytes} bytes")
