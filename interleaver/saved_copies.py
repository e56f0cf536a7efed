"""Saved values leave the step's tensors: at the end of each step, a saved view becomes a copy.

A block's read is a view of the step's flat tensor, which holds every request's tokens: kept as
is, a saved value would pin the whole step's activations and expose other requests' through
`._base`. So at the end of each step (and when a block finishes), the views a block saved under
its own names, and those inside the containers its trace body saved (which the blocks fill), are
replaced by copies. One memo per pass gives a view held in two places one copy, so the names
still point at the same object, as on HF.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from interleaver.grads import carry_grad
from interleaver.nnsight_private import saved_value_ids

if TYPE_CHECKING:
    from interleaver.jobs import Invocation, TraceJob


def unpin_saves(invocations: list[Invocation]) -> None:
    """Replace the blocks' saved views (and those inside their traces' saved containers) by copies."""
    memo: dict[int, Any] = {}
    unpin_block_saves(invocations, memo)
    unpin_client_saves(list({id(inv.job): inv.job for inv in invocations}.values()), memo)


def unpin_block_saves(invocations: list[Invocation], memo: dict[int, Any]) -> None:
    """Replace the saved views the blocks bound to names by copies (the copies are the saved values now)."""
    saved = saved_value_ids()
    replaced: dict[int, Any] = {}  # id of a saved view -> the copy saved in its place
    for invocation in invocations:
        scope = invocation.mediator.lcls
        for name in list(scope.written):
            value = scope.get(name)
            if id(value) not in saved:
                continue
            copy = _unpin(value, memo)
            if copy is not value:
                scope[name] = copy
                replaced[id(value)] = copy
    for view_id, copy in replaced.items():
        saved.discard(view_id)
        saved.add(id(copy))


def unpin_client_saves(jobs: list[TraceJob], memo: dict[int, Any]) -> None:
    """Replace the views inside the containers the trace bodies saved (which their blocks fill) by copies."""
    for job in jobs:
        for value in job.client_saves:
            _unpin(value, memo)


def _unpin(value: Any, memo: dict[int, Any]) -> Any:
    """`value` with tensor views replaced by copies (lists and dicts edited in place).

    A read is a view of the step's flat tensor, which holds every request's tokens: kept as is,
    a saved value would pin the whole step's activations and expose other requests' through
    `._base`. Called at the end of each step, when no block can still edit the view in place.
    """
    key = id(value)
    if key in memo:
        return memo[key]
    memo[key] = value
    if isinstance(value, torch.Tensor):
        result = value.clone() if value._base is not None else value
        if result is not value:
            carry_grad(value, result)
    elif isinstance(value, list):
        _unpin_items(value, memo)
        result = value
    elif isinstance(value, dict):
        for name in list(value):
            value[name] = _unpin(value[name], memo)
        result = value
    elif isinstance(value, tuple):
        items = [_unpin(item, memo) for item in value]
        result = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    else:
        result = value
    memo[key] = result
    return result


def _unpin_items(items: list, memo: dict[int, Any]) -> None:
    """`_unpin` each item of a list in place.

    A list a trace saves grows every step (`saved.append(layer.output)` under `tracer.all()`) and is
    walked every step, so a tensor that owns its memory (a copy made at an earlier step) is passed
    over here at the cost of two attribute reads rather than a call.
    """
    for index, item in enumerate(items):
        if type(item) is torch.Tensor and item._base is None:
            continue
        unpinned = _unpin(item, memo)
        if unpinned is not item:
            items[index] = unpinned
