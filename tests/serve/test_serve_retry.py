"""The serve client's retries of 429 and 503, against a stand-in server that answers from a script.

A real server's 429 is in test_serve_lifecycle.py; a 503 (starting or stopping) is hard to time
there, so a small HTTP server on 127.0.0.1 plays it: its answers and the times they were asked are
the oracle.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nnrun.serve.transport import Connection

pytestmark = pytest.mark.slow


class ScriptedServer:
    """Answers POSTs with the next (status, Retry-After) of its script; records when each came."""

    def __init__(self, script: list[tuple[int, str | None]]) -> None:
        self.script = list(script)
        self.arrivals: list[float] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.arrivals.append(time.monotonic())
                status, retry_after = outer.script.pop(0) if outer.script else (200, None)
                body = b"answer" if status == 200 else b'{"detail": "busy"}'
                self.send_response(status)
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    servers = []

    def start(script):
        servers.append(ScriptedServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_429_and_503_are_retried_after_retry_after(scripted):
    server = scripted([(503, "0.3"), (429, "0.2"), (200, None)])
    connection = Connection(server.url, None)
    assert connection.post("/v1/nnsight/generate", b"trace") == b"answer"
    gaps = [later - earlier for earlier, later in zip(server.arrivals, server.arrivals[1:])]
    assert len(gaps) == 2 and gaps[0] >= 0.3 and gaps[1] >= 0.2 and sum(gaps) < 0.5 + 1.0
    connection.close()


def test_giving_up_says_how_many_tries_over_how_long(scripted):
    server = scripted([(429, "0.2")] * 10)
    connection = Connection(server.url, None, max_retries=2)
    with pytest.raises(ConnectionError, match=r"answered 429: busy \(gave up after 3 tries over 0\.4 s"):
        connection.post("/v1/nnsight/generate", b"trace")
    assert len(server.arrivals) == 3

    within = Connection(server.url, None, retry_timeout=0.5)  # the third wait would pass 0.5 s
    with pytest.raises(ConnectionError, match="gave up after 3 tries"):
        within.post("/v1/nnsight/generate", b"trace")
    for other in (connection, within):
        other.close()


def test_other_errors_are_never_retried(scripted):
    server = scripted([(500, None), (200, None)])
    with pytest.raises(ConnectionError, match="answered 500"):
        Connection(server.url, None).post("/v1/nnsight/generate", b"trace")
    assert len(server.arrivals) == 1  # a trace is not idempotent: only "did not run" answers are sent again
    with pytest.raises(ValueError, match="max_retries"):
        Connection(server.url, None, max_retries=-1)
