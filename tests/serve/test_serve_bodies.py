"""One body limit and one body timeout on every route: 413 while the body streams in, 408 for a stalled body,
and a request counts against the in-flight cap only once its body has arrived.
"""

from __future__ import annotations

import select
import time

import httpx
import pytest
from serve_helpers import API_KEY, ServerProcess, raw_socket, read_until_closed, rss_bytes

import nnrun

pytestmark = pytest.mark.slow

BODY_TIMEOUT_S = 2.0
MAX_BODY_MB = 1
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/nnsight/generate", "/v1/nnsight/register/r1"]
PROMPT = "The Colosseum is in"


@pytest.fixture(scope="module")
def limited():
    process = ServerProcess(
        "--max-body-mb",
        str(MAX_BODY_MB),
        "--body-timeout",
        str(BODY_TIMEOUT_S),
        "--max-in-flight",
        "2",
        "--max-new-tokens",
        "16",
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def request_head(path: str, extra: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def send_until_answered(sock, total_bytes: int, chunk_bytes: int = 64 * 2**10) -> tuple[int, bytes]:
    """Send a chunked body of `total_bytes` until the server answers or closes; (bytes sent, answer)."""
    chunk = b"%x\r\n%s\r\n" % (chunk_bytes, b"x" * chunk_bytes)
    sent = 0
    while sent < total_bytes:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            break
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += chunk_bytes
    return sent, read_until_closed(sock, timeout=10)


def test_an_oversized_body_is_refused_while_it_streams_on_every_route(limited):
    httpx.get(f"{limited.url}/health", timeout=10)
    before = rss_bytes(limited)
    for path in ROUTES:
        with raw_socket(limited) as sock:  # no Content-Length: only counting the bytes can tell
            sock.sendall(request_head(path, "Transfer-Encoding: chunked\r\n"))
            sent, answer = send_until_answered(sock, 100 * 2**20)
        assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
        assert b"over this server's limit of 1048576 bytes" in answer
        assert sent < 20 * 2**20, f"{path}: {sent} bytes were taken before the 413 (the kernel's buffers hold a few MB)"

        with raw_socket(limited) as sock:  # a declared size over the limit: refused before any body byte
            sock.sendall(request_head(path, f"Content-Length: {100 * 2**20}\r\n"))
            assert read_until_closed(sock, timeout=5).startswith(b"HTTP/1.1 413"), path
    grown = rss_bytes(limited) - before
    assert grown < 32 * 2**20, f"the server grew {grown / 2**20:.0f} MB refusing 100 MB bodies on {len(ROUTES)} routes"


def test_stalled_bodies_hold_no_in_flight_slot_and_are_dropped_after_the_body_timeout(limited, local_model):
    stalled = []
    for i in range(6):  # three times the in-flight cap
        sock = raw_socket(limited)
        sock.sendall(request_head(ROUTES[i % len(ROUTES)], "Content-Length: 1000\r\n") + b'{"model": "tiny')
        stalled.append((sock, time.monotonic()))
    try:
        body = {"model": "tiny-facts", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        answer = httpx.post(
            f"{limited.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
        )
        assert answer.status_code == 200, answer.text  # not 429: the stalled requests hold no slot
        expected = local_model.engine.generate(PROMPT, nnrun.SamplingParams(max_tokens=6, temperature=0))[0]
        assert answer.json()["choices"][0]["text"] == expected.outputs[0].text

        for sock, sent_at in stalled:
            response = read_until_closed(sock, timeout=BODY_TIMEOUT_S + 5)
            took = time.monotonic() - sent_at
            assert response.startswith(b"HTTP/1.1 408") and b"did not all arrive" in response, response[:200]
            assert BODY_TIMEOUT_S - 0.5 < took < BODY_TIMEOUT_S + 3, took
    finally:
        for sock, _ in stalled:
            sock.close()
