"""The serve client's HTTP: POST bytes, get bytes back, any failure a ConnectionError.

Built on the standard library's `http.client` with keep-alive connections, rather than httpx:
a trace is one small POST, and with many clients on one machine every bit of client CPU is taken
from the server. A POST through `http.client` costs about 0.15 ms of CPU, through httpcore's pool
0.35 ms and through `httpx.Client` 0.7 ms (measured against `nnrun serve` on loopback).

Connections are pooled (one per thread sending at once) and reused. Before reusing one, a
readable socket means the server closed it (a restart, an idle timeout): it is dropped and a
fresh one opened, so a POST is never sent on a connection already known to be dead, and never
retried once sent (a trace is not idempotent), with one exception: an answer of 429 (the server is
serving its limit of requests) or 503 (it is starting or stopping) says the request did not run,
so it is sent again after the server's `Retry-After`, at most `max_retries` times and only while
the waits fit in `retry_timeout` seconds; giving up says how many tries it made over how long.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from typing import Any
from urllib.parse import urlencode, urlsplit

from nnrun.serve import wire

_TRANSPORT_ERRORS = (OSError, http.client.HTTPException)  # socket errors, timeouts, a malformed answer
RETRIED_STATUSES = (429, 503)  # the server did not run the request: sending it again is safe
MAX_RETRIES = 4
RETRY_TIMEOUT_S = 60.0
FIRST_BACKOFF_S = 0.5  # without a Retry-After: 0.5, 1, 2, 4 s


class Connection:
    """Keep-alive connections to one `nnrun serve` URL; safe to share between threads."""

    def __init__(
        self, url: str, api_key: str | None, max_retries: int = MAX_RETRIES, retry_timeout: float = RETRY_TIMEOUT_S
    ) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if isinstance(retry_timeout, bool) or not isinstance(retry_timeout, (int, float)) or retry_timeout < 0:
            raise ValueError(f"retry_timeout must be a number of seconds >= 0, got {retry_timeout!r}")
        self.max_retries = max_retries
        self.retry_timeout = float(retry_timeout)
        self.url = url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"serve= takes an http:// or https:// URL, not {url!r}")
        self.scheme, self.host, self.port = parts.scheme, parts.hostname or "127.0.0.1", parts.port
        self.prefix = parts.path.rstrip("/")
        self.headers = wire.headers(api_key)
        self.idle: list[http.client.HTTPConnection] = []
        self.lock = threading.Lock()

    def post(self, path: str, content: bytes, params: Any = None, method: str = "POST") -> bytes:
        """The answer's body; a transport failure or a non-200 answer is a ConnectionError (429/503 retried first)."""
        target = f"{self.prefix}{path}" + (f"?{urlencode(params)}" if params else "")
        started = time.monotonic()
        for retry in range(self.max_retries + 1):
            status, body, response = self._exchange(method, target, content)
            if status == 200:
                return body
            message = wire.http_error_message(self.url, status, _detail(body, response))
            if status not in RETRIED_STATUSES:
                raise ConnectionError(message)
            wait = _retry_after(response.getheader("retry-after"), retry)
            elapsed = time.monotonic() - started
            if retry == self.max_retries or elapsed + wait > self.retry_timeout:
                raise ConnectionError(
                    f"{message} (gave up after {retry + 1} tries over {elapsed:.1f} s: this client "
                    f"retries {RETRIED_STATUSES} at most {self.max_retries} times within "
                    f"{self.retry_timeout:g} s, max_retries= and retry_timeout= set that)"
                )
            time.sleep(wait)
        raise AssertionError("unreachable: the last try returns or raises")

    def _exchange(self, method: str, target: str, content: bytes) -> tuple[int, bytes, http.client.HTTPResponse]:
        """One request on a pooled connection: (status, body, response)."""
        connection = self._checkout()
        try:
            connection.request(method, target, body=content, headers=self.headers)
            response = connection.getresponse()
            body = response.read()
        except _TRANSPORT_ERRORS as error:
            connection.close()
            raise ConnectionError(
                f"could not reach nnrun serve at {self.url}: {type(error).__name__}: {error}"
            ) from None
        if response.will_close:
            connection.close()
        else:
            with self.lock:
                self.idle.append(connection)
        return response.status, body, response

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for connection in idle:
            connection.close()

    def _checkout(self) -> http.client.HTTPConnection:
        """An idle connection the server has not closed, or a new one (connected on first use)."""
        while True:
            with self.lock:
                connection = self.idle.pop() if self.idle else None
            if connection is None:
                return self._new()
            if _is_open(connection):
                return connection
            connection.close()

    def _new(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        connection = kind(self.host, self.port, timeout=wire.CONNECT_TIMEOUT_S)
        try:
            connection.connect()
        except OSError as error:
            raise ConnectionError(
                f"could not reach nnrun serve at {self.url}: {type(error).__name__}: {error}"
            ) from None
        connection.sock.settimeout(wire.READ_TIMEOUT_S)  # a trace may queue; the server's own limit ends it first
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and body go as sent
        return connection


def _is_open(connection: http.client.HTTPConnection) -> bool:
    """False when an idle keep-alive socket is readable: the server closed it (or sent what nobody asked for)."""
    sock = connection.sock
    if sock is None:
        return False
    poller = select.poll()  # not select.select: a notebook's process can hold file descriptors past 1024
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    try:
        return not poller.poll(0)
    except OSError:
        return False


def _retry_after(header: str | None, retry: int) -> float:
    """Seconds to wait before try `retry + 2`: the server's Retry-After (seconds), else a doubling backoff."""
    try:
        return min(max(float(header), 0.0), RETRY_TIMEOUT_S)
    except (TypeError, ValueError):  # absent, or an HTTP date (nnrun serve sends seconds)
        return FIRST_BACKOFF_S * 2**retry


def _detail(body: bytes, response: http.client.HTTPResponse) -> str:
    """FastAPI's `{"detail": ...}`, or the status's reason phrase."""
    try:
        return str(json.loads(body).get("detail"))
    except (ValueError, AttributeError):
        return response.reason
