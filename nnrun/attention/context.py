"""The one piece of module-level state: what serves the forward that is running now.

That is the attention backend, the step's attention-probabilities plan when some request of the
step asked for them, the step's per-request positions (the `[1, N]` position ids the model is
given) for modules that number positions themselves (nnrun/position_adapters.py), for a
model with mixer layers, the step's view of the state pool (nnrun/state), and for a model with
sparse-attention indexers, the step's view of their key pool (nnrun/attention/indexer). A plain global,
not a ContextVar: nnsight's mediators are greenlets, which start with an empty contextvars context,
and they may call modules during the forward.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

from nnrun.attention.base import AttentionBackend

if TYPE_CHECKING:
    from nnrun.attention.indexer.step import IndexerStep
    from nnrun.attention.probabilities import AttentionProbsPlan
    from nnrun.state.step import StateStep

_current_backend: AttentionBackend | None = None
_current_probs_plan: AttentionProbsPlan | None = None
_current_position_ids: torch.Tensor | None = None
_current_state_step: StateStep | None = None
_current_indexer_step: IndexerStep | None = None


class _ForwardContext:
    """Serves `state` (backend, probs plan, position ids) for one forward; re-entrant, the outer one restored.

    A class rather than a generator: it is entered once per step, where a generator's frame costs more.
    """

    __slots__ = ("state", "previous")

    def __init__(self, state: tuple) -> None:
        self.state = state

    def __enter__(self) -> None:
        global _current_backend, _current_probs_plan, _current_position_ids
        self.previous = _current_backend, _current_probs_plan, _current_position_ids
        _current_backend, _current_probs_plan, _current_position_ids = self.state

    def __exit__(self, *exc: object) -> None:
        global _current_backend, _current_probs_plan, _current_position_ids
        _current_backend, _current_probs_plan, _current_position_ids = self.previous


def forward_context(
    backend: AttentionBackend, probs_plan: AttentionProbsPlan | None = None, position_ids: torch.Tensor | None = None
) -> AbstractContextManager[None]:
    return _ForwardContext((backend, probs_plan, position_ids))


def current_backend() -> AttentionBackend | None:
    return _current_backend


def current_position_ids() -> torch.Tensor | None:
    """The running step's `[1, N]` per-request positions (0-based), or None outside a step that set them."""
    return _current_position_ids


def current_probs_plan() -> AttentionProbsPlan | None:
    """The requests of the running step that asked for attention probabilities; None if none did."""
    return _current_probs_plan


@contextmanager
def state_step_context(step: StateStep) -> Iterator[None]:
    global _current_state_step
    previous, _current_state_step = _current_state_step, step
    try:
        yield
    finally:
        _current_state_step = previous


def current_state_step() -> StateStep | None:
    """The running packed step's view of the state pool, or None outside one (mixers then run as HF's)."""
    return _current_state_step


@contextmanager
def indexer_step_context(step: IndexerStep) -> Iterator[None]:
    global _current_indexer_step
    previous, _current_indexer_step = _current_indexer_step, step
    try:
        yield
    finally:
        _current_indexer_step = previous


def current_indexer_step() -> IndexerStep | None:
    """The running packed step's view of the indexer key pool, or None outside one."""
    return _current_indexer_step
