"""The serve client's HTTP: POST bytes, get bytes back, any failure a ConnectionError.

Built on httpcore's connection pool (what httpx itself sends with) rather than `httpx.Client`:
a trace is one small POST, and httpx's request building, cookie jar and redirect handling cost
about 0.35 ms of client CPU each, a sixth of what a served trace costs its client; with many
clients on one machine that CPU is taken from the server. The pool is thread-safe and keeps
connections alive; one the server closed (a restart) is dropped before reuse, as under httpx.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

import httpcore

from nnrun.serve import wire

_TRANSPORT_ERRORS = (httpcore.NetworkError, httpcore.TimeoutException, httpcore.ProtocolError,
                     httpcore.UnsupportedProtocol)


class Connection:
    """Keep-alive connections to one `nnrun serve` URL."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url
        self.headers = list(wire.headers(api_key).items())
        self.timeouts = {"connect": wire.CONNECT_TIMEOUT_S, "read": wire.READ_TIMEOUT_S,
                         "write": wire.READ_TIMEOUT_S, "pool": wire.READ_TIMEOUT_S}
        self.pool = httpcore.ConnectionPool()

    def post(self, path: str, content: bytes, params: Any = None) -> bytes:
        """The answer's body; a transport failure or a non-200 answer is a ConnectionError."""
        url = f"{self.url}{path}" + (f"?{urlencode(params)}" if params else "")
        try:
            response = self.pool.request("POST", url, headers=self.headers, content=content,
                                         extensions={"timeout": self.timeouts})
        except _TRANSPORT_ERRORS as error:
            raise ConnectionError(f"could not reach nnrun serve at {self.url}: {type(error).__name__}: {error}") \
                from None
        if response.status != 200:
            raise ConnectionError(wire.http_error_message(self.url, response.status, _detail(response)))
        return response.content

    def close(self) -> None:
        self.pool.close()


def _detail(response: httpcore.Response) -> str:
    """FastAPI's `{"detail": ...}`, or the status's reason phrase."""
    try:
        return str(json.loads(response.content).get("detail"))
    except (ValueError, AttributeError):
        return response.extensions.get("reason_phrase", b"").decode("ascii", "replace")
