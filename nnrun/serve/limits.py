"""Auth and limits: the API key (401), the body's size (413) and time (408), the requests in flight (429).

Keys are compared with `hmac.compare_digest`, which takes the same time however much of a wrong
key matches. Every route's body is read here, before any route runs: refused with 413 as soon as
it passes the limit (not after buffering it), and with 408 if it has not all arrived within the
body timeout, so a client that sends headers and then stalls holds nothing for long. Only a
request whose body has arrived counts against the in-flight cap, which counts HTTP requests being
served (running or waiting for the engine); one past it is refused at once with 429 and a
`Retry-After`, rather than queued, so a client sees back-pressure instead of a timeout. `/health`
needs no key and is never refused. (Header size and time are bounded below this, per connection:
`http_limits`.) Refusals on the OpenAI routes take OpenAI's error shape (`openai_errors`).
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import HTTPException, Request
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from nnrun.serve.openai_errors import error_response
from nnrun.serve.wire import API_KEY_HEADER

OPEN_PATHS = ("/health",)


class Guard:
    """ASGI middleware around every route but `/health`: the key, then the body (size, time), then the in-flight cap.

    Plain ASGI rather than a route dependency, so a streamed answer (SSE) counts as in flight
    until its last byte is sent. The app gets the body already read (`_replay`).
    """

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_in_flight: int, max_body_bytes: int, body_timeout_s: float
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_in_flight = max_in_flight
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.num_in_flight = 0  # only touched on the event loop's thread

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not self.is_authorized(headers):
            await _refuse(scope, receive, send, 401, "missing or invalid API key", {"WWW-Authenticate": "Bearer"})
            return
        try:
            body = await read_asgi_body(
                receive, headers.get("content-length"), self.max_body_bytes, self.body_timeout_s
            )
        except HTTPException as error:  # the client may still be sending: answer, then close the connection
            await _refuse(scope, receive, send, error.status_code, error.detail, {"Connection": "close"})
            return
        except ClientDisconnect:
            return
        if self.num_in_flight >= self.max_in_flight:
            await _refuse(
                scope,
                receive,
                send,
                429,
                f"this server is serving its limit of {self.max_in_flight} requests; retry shortly",
                {"Retry-After": "1"},
            )
            return
        self.num_in_flight += 1
        try:
            await self.app(scope, _replay(body, receive), send)
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


async def _refuse(
    scope: Scope, receive: Receive, send: Send, status_code: int, detail: str, headers: dict[str, str]
) -> None:
    """Answer a refusal in the shape the path's clients read (OpenAI's on the OpenAI routes)."""
    await error_response(scope["path"], status_code, detail, headers)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's `receive`: the body already read, then the connection's own messages (a disconnect)."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it passes `max_bytes` (whatever Content-Length claimed)."""
    return await read_asgi_body(request.receive, request.headers.get("content-length"), max_bytes)


async def read_asgi_body(
    receive: Receive, content_length: str | None, max_bytes: int, timeout_s: float | None = None
) -> bytes:
    """`read_body` from the ASGI messages themselves; `ClientDisconnect` if the client goes first.

    `timeout_s`: 408 if the whole body has not arrived within that many seconds.
    """
    _check_declared(content_length, max_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
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
    except TimeoutError:
        raise HTTPException(
            status_code=408, detail=f"the request body did not all arrive within this server's limit of {timeout_s:g} s"
        ) from None


def _check_declared(content_length: str | None, max_bytes: int) -> None:
    if content_length is not None and content_length.isdigit() and int(content_length) > max_bytes:
        raise _too_large(max_bytes)


def _too_large(max_bytes: int) -> HTTPException:
    return HTTPException(status_code=413, detail=f"request body over this server's limit of {max_bytes} bytes")
