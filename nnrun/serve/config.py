"""ServeConfig: where the server listens, who may use it, and what one request may take."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PORT = 8000


@dataclass
class ServeConfig:
    """The server's settings; the engine's own options travel in `engine_kwargs`."""

    model: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_body_bytes: int = 64 * 2**20  # a trace's payload: its block, and the tensors it carries
    body_timeout_s: float = 30.0  # from a request's headers to the last byte of its body (a stalled body is dropped)
    max_header_bytes: int = 64 * 2**10  # one request's headers; checked before the key, so anyone can send them
    header_timeout_s: float = 10.0  # from a request's first byte to the end of its headers (slowloris)
    max_connections: int = 1024  # open at once; more are closed as they open
    request_timeout_s: float = 300.0  # wall clock from arrival (queueing included) to the answer
    block_timeout_s: float = 10.0  # how long one block may hold the engine thread without parking
    max_new_tokens: int = 4096  # per request (a generation's max_new_tokens, a completion's max_tokens)
    max_in_flight: int = 64  # HTTP requests running or queued at once; more are answered 429
    drain_timeout_s: float = 60.0  # on SIGTERM, how long in-flight requests may take to finish
    served_model_name: str | None = None  # the name OpenAI clients send as `model` (default: `model`)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"ServeConfig.port must be an int in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServeConfig.api_key must be a non-empty string or None")
        for name in ("max_body_bytes", "max_header_bytes", "max_new_tokens", "max_in_flight", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServeConfig.{name} must be a positive int, got {value!r}")
        for name in ("request_timeout_s", "block_timeout_s", "drain_timeout_s", "body_timeout_s", "header_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ServeConfig.{name} must be a positive number of seconds, got {value!r}")
        if self.api_key is None and not is_loopback(self.host):
            raise ValueError(
                f"ServeConfig.host={self.host!r} is reachable from other machines, and anyone who can reach the "
                "server can run code in it (a trace is Python). Give an API key (--api-key, or NNRUN_API_KEY), or "
                "bind 127.0.0.1"
            )
        if self.served_model_name is None:
            self.served_model_name = self.model


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine ("localhost" counts; "" and "0.0.0.0" do not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
