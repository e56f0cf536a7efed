"""The one piece of module-level state: what serves the forward that is running now.

That is the attention backend, and the step's attention-probabilities plan when some request of
the step asked for them. A plain global, not a ContextVar: nnsight's mediators are greenlets,
which start with an empty contextvars context, and they may call modules during the forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from nnrun.attention.base import AttentionBackend

if TYPE_CHECKING:
    from nnrun.attention.probabilities import AttentionProbsPlan

_current_backend: AttentionBackend | None = None
_current_probs_plan: AttentionProbsPlan | None = None


@contextmanager
def forward_context(backend: AttentionBackend, probs_plan: AttentionProbsPlan | None = None) -> Iterator[None]:
    global _current_backend, _current_probs_plan
    previous = _current_backend, _current_probs_plan
    _current_backend, _current_probs_plan = backend, probs_plan
    try:
        yield
    finally:
        _current_backend, _current_probs_plan = previous


def current_backend() -> AttentionBackend | None:
    return _current_backend


def current_probs_plan() -> AttentionProbsPlan | None:
    """The requests of the running step that asked for attention probabilities; None if none did."""
    return _current_probs_plan
