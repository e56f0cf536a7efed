"""The one piece of module-level state: the backend serving the forward that is running now.

A plain global, not a ContextVar: nnsight's mediators are greenlets, which start with an empty
contextvars context, and they may call modules during the forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from nnrun.attention.base import AttentionBackend

_current_backend: AttentionBackend | None = None


@contextmanager
def forward_context(backend: AttentionBackend) -> Iterator[None]:
    global _current_backend
    previous, _current_backend = _current_backend, backend
    try:
        yield
    finally:
        _current_backend = previous


def current_backend() -> AttentionBackend | None:
    return _current_backend
