"""A hostile client process for the soak test: garbage, slowloris, stalled bodies, huge headers, bad payloads.

`python hostile_client.py '{"host": ..., "port": ..., "api_key": ..., "seconds": ..., "stop_file": ...}'`
runs rounds of abuse until `seconds` pass or `stop_file` exists, then prints what it sent as JSON.
Plain sockets only: it starts at once and holds no model.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def connect(spec: dict) -> socket.socket:
    return socket.create_connection((spec["host"], spec["port"]), timeout=5)


def send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the server closed it: what it should do
        pass


def exchange(spec: dict, data: bytes) -> bytes:
    """Send `data` on a fresh connection; whatever the server answers before closing (or 5 s)."""
    with connect(spec) as sock:
        send_quietly(sock, data)
        try:
            return sock.recv(256)
        except OSError:
            return b""


def main() -> int:
    spec = json.loads(sys.argv[1])
    key = spec["api_key"]
    deadline = time.monotonic() + spec["seconds"]
    sent = {"garbage": 0, "slowloris": 0, "stalled_bodies": 0, "huge_headers": 0, "bad_payloads": 0, "bad_json": 0}
    lingering: list[socket.socket] = []  # slowloris and stalled connections, left for the server to close
    while time.monotonic() < deadline and not os.path.exists(spec["stop_file"]):
        exchange(spec, os.urandom(4096))  # not HTTP at all
        sent["garbage"] += 1
        sock = connect(spec)
        send_quietly(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never ends its headers
        lingering.append(sock)
        sent["slowloris"] += 1
        sock = connect(spec)
        send_quietly(
            sock,
            f"POST /v1/nnsight/generate HTTP/1.1\r\nHost: x\r\nndif-api-key: {key}\r\n"
            "Content-Length: 100000\r\n\r\npartial".encode(),
        )  # never sends the rest
        lingering.append(sock)
        sent["stalled_bodies"] += 1
        exchange(spec, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Huge: " + b"h" * (512 * 1024) + b"\r\n\r\n")
        sent["huge_headers"] += 1
        payload = os.urandom(2048)
        exchange(
            spec,
            f"POST /v1/nnsight/generate HTTP/1.1\r\nHost: x\r\nndif-api-key: {key}\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload,
        )
        sent["bad_payloads"] += 1
        body = b'{"model": "tiny-facts", "prompt": 5, "max_tokens": "lots", "stream": "yes"'
        exchange(
            spec,
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body,
        )
        sent["bad_json"] += 1
        while len(lingering) > 40:  # the server closes them after its timeouts; keep at most 40 around
            lingering.pop(0).close()
        time.sleep(0.05)
    for sock in lingering:
        sock.close()
    print(json.dumps(sent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
