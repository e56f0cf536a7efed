"""Saved values leave the step's tensors: at the end of each step, a saved view becomes a copy.

A block's read is a view of the step's flat tensor, which holds every request's tokens: kept as
is, a saved value would pin the whole step's activations and expose other requests' through
`._base`. So at the end of each step (and when a block finishes), the views a block saved under
its own names, and those inside the containers its trace body saved (which the blocks fill), are
replaced by copies. One memo per pass gives a view held in two places one copy, so the names
still point at the same object, as on HF.
"""

from __future__ import annotations

from operator import is_
from typing import TYPE_CHECKING, Any

import torch

from interleaver.grads import carry_grad
from interleaver.nnsight_private import saved_value_ids

if TYPE_CHECKING:
    from interleaver.jobs import Invocation, TraceJob


# id(list) -> (the list, a copy of its first items as the last pass left them: plain tensors that own their memory)
Walked = dict[int, tuple[list, list]]


def unpin_saves(invocations: list[Invocation], walked: dict[int, Walked] | None = None) -> None:
    """Replace the blocks' saved views (and those inside their traces' saved containers) by copies.

    `walked`: per id(job), what earlier passes found in its saved lists (see `_Copies`), kept by the caller
    until the job ends; without it every list is walked whole.
    """
    memo: dict[int, Any] = {}
    unpin_block_saves(invocations, memo, walked)
    unpin_client_saves(list({id(inv.job): inv.job for inv in invocations}.values()), memo, walked)


def unpin_block_saves(
    invocations: list[Invocation], memo: dict[int, Any], walked: dict[int, Walked] | None = None
) -> None:
    """Replace the saved views the blocks bound to names by copies (the copies are the saved values now)."""
    saved = saved_value_ids()
    copies = _Copies(memo)
    replaced: dict[int, Any] = {}  # id of a saved view -> the copy saved in its place
    for invocation in invocations:
        copies.lists = {} if walked is None else walked.setdefault(id(invocation.job), {})
        scope = invocation.mediator.lcls
        for name in list(scope.written):
            value = scope.get(name)
            if id(value) not in saved:
                continue
            copy = copies.unpin(value)
            if copy is not value:
                scope[name] = copy
                replaced[id(value)] = copy
    copies.fill()
    for view_id, copy in replaced.items():
        saved.discard(view_id)
        saved.add(id(copy))


def unpin_client_saves(jobs: list[TraceJob], memo: dict[int, Any], walked: dict[int, Walked] | None = None) -> None:
    """Replace the views inside the containers the trace bodies saved (which their blocks fill) by copies."""
    copies = _Copies(memo)
    for job in jobs:
        copies.lists = {} if walked is None else walked.setdefault(id(job), {})
        for value in job.client_saves:
            copies.unpin(value)
    copies.fill()


class _Copies:
    """One pass's copies of saved views: each a fresh tensor of its own, filled together by `fill`.

    A view that carries autograd state is cloned on the spot (the clone joins the graph, see
    `carry_grad`); every other is given an empty tensor of its shape and strides (as `clone` would
    make) at once, and the pass copies into all of them with one `torch._foreach_copy_`: on a GPU,
    one launch per step rather than one per saved value. A saved list that gained many plain views
    since the last pass (every request's read of every layer) has them copied by one
    `torch._foreach_clone` of their own (`_copy_new_views`): the same copies, allocated in C++. The copies never share storage: each
    request's saved values are its own. `memo` (id of a value -> what it became) gives a view held
    in two places one copy.

    A list a trace saves grows every step (`saved.append(layer.output)` under `tracer.all()`) and is
    walked every step. `lists` (the current job's) remembers, per list, its first items as the last
    pass left them, when those were all plain tensors owning their memory (copies made at earlier
    steps, which never become views again): if the list still starts with the very same objects (one
    identity comparison per item, in C), only the items after them are visited in Python. The pass
    still compares and re-slices that prefix, so it stays linear in what the trace holds, at a smaller
    cost per item than the Python walk.
    """

    def __init__(self, memo: dict[int, Any]) -> None:
        self.memo = memo
        self.lists: Walked = {}
        self.views: list[torch.Tensor] = []  # the views to copy ...
        self.copies: list[torch.Tensor] = []  # ... into these (same shapes), at `fill`

    def fill(self) -> None:
        """Copy every view of the pass into its new tensor (before anyone can read the copies)."""
        if self.views:
            torch._foreach_copy_(self.copies, self.views)
            self.views, self.copies = [], []

    def unpin(self, value: Any) -> Any:
        """`value` with tensor views replaced by copies (lists and dicts edited in place).

        A read is a view of the step's flat tensor, which holds every request's tokens: kept as is,
        a saved value would pin the whole step's activations and expose other requests' through
        `._base`. Called at the end of each step, when no block can still edit the view in place.
        """
        memo = self.memo
        key = id(value)
        if key in memo:
            return memo[key]
        memo[key] = value
        if isinstance(value, torch.Tensor):
            result = self._copy(value) if value._base is not None else value
        elif isinstance(value, list):
            self._unpin_items(value)
            result = value
        elif isinstance(value, dict):
            for name in list(value):
                value[name] = self.unpin(value[name])
            result = value
        elif isinstance(value, tuple):
            items = [self.unpin(item) for item in value]
            result = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        else:
            result = value
        memo[key] = result
        return result

    def _copy(self, view: torch.Tensor) -> torch.Tensor:
        if type(view) is not torch.Tensor or view.requires_grad:
            copy = view.clone()
            carry_grad(view, copy)
            return copy
        copy = torch.empty_like(view)  # view's shape and strides, as `clone` keeps them
        self.views.append(view)
        self.copies.append(copy)
        return copy

    def _unpin_items(self, items: list) -> None:
        """`unpin` each item of a list in place, from the first one the last pass did not leave owned."""
        known = self.lists.get(id(items))
        start = 0
        if known is not None and known[0] is items and len(known[1]) <= len(items) and all(map(is_, items, known[1])):
            start = len(known[1])  # (`map` stops at the shorter: the known items are compared)
        if self._copy_new_views(items, start):
            return
        owned = True  # whether items[:index] are all plain tensors that own their memory
        memo = self.memo
        for index in range(start, len(items)):
            item = items[index]
            if type(item) is torch.Tensor:  # the common case, without `unpin`'s dispatch
                if item._base is None:
                    continue
                unpinned = memo.get(id(item))
                if unpinned is None:  # (a copy is a plain tensor that owns its memory)
                    unpinned = memo[id(item)] = self._copy(item)
            else:
                unpinned = self.unpin(item)
                if owned and not (type(unpinned) is torch.Tensor and unpinned._base is None):
                    owned, end = False, index  # (a container is walked again every pass: it may change)
            if unpinned is not item:
                items[index] = unpinned
        self.lists[id(items)] = (items, items[: len(items) if owned else end])

    def _copy_new_views(self, items: list, start: int) -> bool:
        """`_unpin_items`'s common case in one go: the items from `start` on are distinct plain views without
        autograd state, met nowhere else this pass (`saved.append(layer.output)` every step); False otherwise.

        Each gets a copy of its own, as `_copy` gives it: made by one `torch._foreach_clone` when the list
        gained at least `MIN_CLONED_TOGETHER` of them (the allocations in C++, and one copy launch on a GPU),
        else joining the pass's copies (`fill`).
        """
        tail = items[start:]
        if not tail or not all(type(t) is torch.Tensor and t._base is not None and not t.requires_grad for t in tail):
            return False
        ids = list(map(id, tail))
        memo = self.memo
        if not memo.keys().isdisjoint(ids) or len(set(ids)) != len(ids):
            return False
        if len(tail) >= MIN_CLONED_TOGETHER:
            copied = torch._foreach_clone(tail)  # each view's shape and strides, as `clone` keeps them
        else:
            copied = [self._copy(view) for view in tail]  # (filled with the pass's other copies)
        memo.update(zip(ids, copied))
        items[start:] = copied
        self.lists[id(items)] = (items, items[:])  # (the copies own their memory, as the known prefix does)
        return True


# A list's new views copied by one `_foreach_clone` of their own from this many on (fewer join the pass's copy).
MIN_CLONED_TOGETHER = 8
