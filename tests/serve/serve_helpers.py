"""Processes for the serve tests: `nnrun serve tiny-facts` on 127.0.0.1, and client processes.

Every wait is bounded; whoever starts a process kills it (see the fixtures in conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent
REPO = HERE.parent.parent
START_TIMEOUT_S = 90.0
CLIENT_TIMEOUT_S = 120.0
API_KEY = "test-key-7f3a"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")])
    return env


class ServerProcess:
    """`nnrun serve` in a subprocess; `stop()` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, *args: str, port: int | None = None, api_key: str | None = API_KEY) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        command = [
            sys.executable,
            "-m",
            "nnrun.cli",
            "serve",
            "tiny-facts",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *args,
        ]
        if api_key is not None:
            command += ["--api-key", api_key]
        self.process = subprocess.Popen(
            command, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nnrun serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"nnrun serve did not answer /health within {timeout} s:\n{self.output()}")

    def is_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def output(self) -> str:
        if self.process.poll() is None:
            return "(still running)"
        return self.process.stdout.read() if self.process.stdout else ""

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode


class Client:
    """A client process running workloads (tests/serve/workloads.py) against a server."""

    def __init__(self, url: str, workloads: list[str], out: Path, api_key: str | None = API_KEY) -> None:
        self.out = out
        spec = {"url": url, "api_key": api_key, "workloads": workloads, "out": str(out)}
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "run_client.py"), json.dumps(spec)],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def result(self, timeout: float = CLIENT_TIMEOUT_S) -> dict:
        import torch

        try:
            output, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate(timeout=30)
            raise AssertionError(f"client did not finish within {timeout} s:\n{output}") from None
        assert self.process.returncode == 0, f"client failed ({self.process.returncode}):\n{output}"
        return torch.load(self.out, weights_only=False)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate(timeout=30)


def raw_socket(server: ServerProcess, timeout: float = 10.0) -> socket.socket:
    """A plain TCP connection to the server, for sending what no HTTP client would."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (AssertionError if it has not within `timeout`)."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise AssertionError(
            f"the server did not close the connection within {timeout} s; it sent {received[:200]!r}"
        ) from None
    return received


def rss_bytes(server: ServerProcess) -> int:
    """The server process's resident memory."""
    with open(f"/proc/{server.process.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def slow_trace(model, steps: int):
    """A served generation that takes about `steps` x 0.1 s, parking every step; sent without waiting."""
    with model.generate("The Eiffel Tower is in", max_new_tokens=steps, min_new_tokens=steps, blocking=False) as tracer:
        tokens = list().save()
        for step in tracer.all():
            time.sleep(0.1)
            tokens.append(model.samples)
    return tracer
