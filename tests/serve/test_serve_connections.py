"""What a client without a key can make the server hold: header size (431) and header time (408) are bounded
before authentication, and open connections are capped.
"""

from __future__ import annotations

import select
import time

import httpx
import pytest
from serve_helpers import ServerProcess, raw_socket, read_until_closed, rss_bytes

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 24


@pytest.fixture(scope="module")
def limited():
    process = ServerProcess(
        "--header-timeout", str(HEADER_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS), "--max-header-kb", "64"
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def test_a_200_mb_header_line_is_refused_without_growing_the_server(limited):
    httpx.get(f"{limited.url}/health", timeout=10)
    before = rss_bytes(limited)
    chunk = b"a" * 2**20
    sent = 0
    with raw_socket(limited) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Junk: ")
        while sent < 200 * 2**20:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        answer = read_until_closed(sock, timeout=10)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert sent < 20 * 2**20, f"{sent / 2**20:.0f} MB were taken before the 431 (the kernel's buffers hold a few MB)"
    grown = rss_bytes(limited) - before
    assert grown < 16 * 2**20, f"the server grew {grown / 2**20:.0f} MB"
    # Headers under the limit are served as before.
    assert httpx.get(f"{limited.url}/health", headers={"X-Big": "b" * 32_000}, timeout=10).status_code == 200


def test_slowloris_connections_are_closed_after_the_header_timeout(limited):
    opened = time.monotonic()
    socks = [raw_socket(limited) for _ in range(8)]
    closed_after: dict[int, float] = {}
    answers: dict[int, bytes] = {}
    try:
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        while len(closed_after) < len(socks) and time.monotonic() - opened < HEADER_TIMEOUT_S + 6:
            for i, sock in enumerate(socks):  # one more header line every 0.2 s: never the end of the headers
                if i in closed_after:
                    continue
                if select.select([sock], [], [], 0)[0]:
                    answers[i] = read_until_closed(sock, timeout=5)
                    closed_after[i] = time.monotonic() - opened
                    continue
                try:
                    sock.sendall(b"X-Still-Here: yes\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    closed_after[i] = time.monotonic() - opened
            assert httpx.get(f"{limited.url}/health", timeout=5).status_code == 200  # others are served meanwhile
            time.sleep(0.2)
    finally:
        for sock in socks:
            sock.close()
    assert len(closed_after) == len(socks), f"{len(socks) - len(closed_after)} open after {HEADER_TIMEOUT_S + 6} s"
    assert all(HEADER_TIMEOUT_S - 0.5 < took < HEADER_TIMEOUT_S + 3 for took in closed_after.values()), closed_after
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in answers.values()), answers


def test_connections_past_the_cap_are_closed_as_they_open(limited):
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            socks.append(raw_socket(limited))
        time.sleep(0.5)
        refused = [sock for sock in socks if select.select([sock], [], [], 0)[0] and _is_closed(sock)]
        assert len(refused) >= 8, f"{len(refused)} of {len(socks)} idle connections were closed"
        # Idle connections are closed at the header timeout too, which frees the server for everyone.
        for sock in socks:
            read_until_closed(sock, timeout=HEADER_TIMEOUT_S + 3)
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(f"{limited.url}/health", timeout=10).status_code == 200


def _is_closed(sock) -> bool:
    """For a readable socket that was sent nothing: whether the server closed it."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
