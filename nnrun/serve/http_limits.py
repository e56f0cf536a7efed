"""Limits on what a connection may send before its request is even read: header size, header time, connections.

uvicorn parses HTTP with httptools (half h11's CPU per request), which puts no bound on a header:
a client without any key could grow the server by the size of one header line (200 MB grew it
by about 390 MB), and a connection that sends its headers a byte at a time (slowloris) was never
closed. Authentication cannot help: it needs the headers first. So `LimitedHttpToolsProtocol`,
uvicorn's httptools protocol with three checks per connection, answers before any route runs:

- a request whose headers pass `max_header_bytes` gets 431 and the connection is closed;
- a request whose headers have not all arrived `header_timeout_s` after its first byte (or after
  the connection opened) gets 408 and the connection is closed;
- a connection past `max_connections` open at once is closed as it opens.

Bytes are counted as they arrive, before the parser buffers them, so what one connection can
make the server hold is `max_header_bytes` plus one read (at most 256 KiB). Without httptools
installed, uvicorn's h11 protocol runs instead, with h11's own header size limit (set by the
caller) but neither the header timeout nor the connection cap; the server says so as it starts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: `limited_protocol` falls back to h11
    HttpToolsProtocol = None

logger = logging.getLogger("nnrun.serve")


def limited_protocol(max_header_bytes: int, header_timeout_s: float, max_connections: int) -> type | str:
    """uvicorn's httptools protocol with these limits (pass it as `uvicorn.Config(http=...)`), or "h11" without it."""
    if HttpToolsProtocol is None:
        logger.warning(
            "httptools is not installed: serving with h11, whose header size limit applies, but without "
            "--header-timeout or --max-connections (pip install httptools)"
        )
        return "h11"
    return type(
        "LimitedHttpToolsProtocol",
        (LimitedHttpToolsProtocol,),
        {
            "max_header_bytes": max_header_bytes,
            "header_timeout_s": header_timeout_s,
            "max_connections": max_connections,
        },
    )


class LimitedHttpToolsProtocol(HttpToolsProtocol or object):  # object: never made without httptools
    """One connection: uvicorn's httptools protocol, with header size and time bounded (see the module doc)."""

    max_header_bytes = 64 * 2**10
    header_timeout_s = 10.0
    max_connections = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.is_reading_headers = True  # until the current request's headers are complete
        self.num_header_bytes = 0
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            logger.warning(
                "refused a connection: %d open, this server's limit is %d",
                len(self.connections) - 1,
                self.max_connections,
            )
            transport.abort()  # no response: nothing was read, and the client sees a reset it can retry
            return
        self._arm_header_timer()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.is_reading_headers:
            self.num_header_bytes += len(data)
        super().data_received(data)
        if (
            self.is_reading_headers
            and self.num_header_bytes > self.max_header_bytes
            and not self.transport.is_closing()
        ):
            self._refuse(431, f"request headers over this server's limit of {self.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self.is_reading_headers = False
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.is_reading_headers = True  # the next request on this connection (its timer starts at its first byte)
        self.num_header_bytes = 0

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self.header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timed_out(self) -> None:
        self.header_timer = None
        if not self.is_reading_headers or self.transport.is_closing():
            return
        if self.num_header_bytes == 0:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        self._refuse(408, f"request headers did not arrive within this server's limit of {self.header_timeout_s:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with `message` and close, without the request ever reaching the app."""
        logger.warning("refused a request: %s", message)
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        body = message.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
        )
        self.transport.close()
        self.parser = _ClosedParser()  # what the connection still sends is dropped, not parsed


class _ClosedParser:
    """Stands in for the parser of a connection being closed: whatever arrives is dropped."""

    def feed_data(self, data: bytes) -> None:
        pass

    def should_upgrade(self) -> bool:
        return False
