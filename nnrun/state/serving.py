"""What the runner calls: a state pool for a model with mixer layers, and the context one packed forward runs in."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from nnrun.attention.context import state_step_context
from nnrun.forward_batch import ForwardBatch
from nnrun.state.mixers import adapt_mixers
from nnrun.state.pool import StatePool
from nnrun.state.shared_attention import adapt_shared_attention
from nnrun.state.step import StateStep


def state_pool_for(model: torch.nn.Module, num_rows: int, device: torch.device) -> StatePool | None:
    """Adapt the model's mixer layers and give them a pool of `num_rows` rows; None for a model without any."""
    adapt_shared_attention(model)  # a hybrid's attention shared by its layers pages KV per calling layer
    mixers = adapt_mixers(model)
    return StatePool(num_rows, device, sorted({info.layer_idx for info in mixers})) if mixers else None


@contextmanager
def serve_states(pool: StatePool | None, forward_batch: ForwardBatch) -> Iterator[None]:
    """Around one packed forward: its mixers run on the pool's rows; their new states are kept only if it ends normally."""
    if pool is None:
        yield
        return
    step = StateStep.for_batch(pool, forward_batch, len(pool.mixer_layer_ids))
    with state_step_context(step):
        yield
    step.commit()
