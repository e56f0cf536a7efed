"""Saved values leave the step's tensors: at the end of each step, a saved view becomes a copy.

A block's read is a view of the step's flat tensor, which holds every request's tokens: kept as
is, a saved value would pin the whole step's activations and expose other requests' through
`._base`. So at the end of each step (and when a block finishes), the views a block saved under
its own names, and those inside the containers its trace body saved (which the blocks fill), are
replaced by copies. One memo per pass gives a view held in two places one copy, so the names
still point at the same object, as on HF.

`SavedWalk` is the one walk over a trace's saved values. It copies views, and, given a `Counter`
(the saved-values ledger's, interleaver/save_spill.py), passes every saved tensor through it in
the same walk: the engine's end of step visits each saved value once for both.
"""

from __future__ import annotations

from operator import is_
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from interleaver.grads import carry_grad
from interleaver.nnsight_private import saved_value_ids

if TYPE_CHECKING:
    from interleaver.jobs import Invocation, TraceJob


# id(list) -> (the list, a copy of its first items as the last pass left them: settled, see `SavedWalk`)
Walked = dict[int, tuple[list, list]]


class Counter(Protocol):
    """What a `SavedWalk` asks about each saved tensor (the ledger's `_Counter` in interleaver/save_spill.py)."""

    def count(self, tensor: torch.Tensor, copy: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        """`tensor` counted: as is, `copy(tensor)` (a view, when the walk copies), or a host copy of it."""

    def reserve(self, views: list[torch.Tensor]) -> list[int] | None:
        """Distinct plain views not counted yet, about to be copied: if they all stay on the device, hold
        their bytes and return each one's size; else None (nothing held: they are counted one by one)."""

    def record(self, copies: list[torch.Tensor], sizes: list[int]) -> None:
        """The copies of the views `reserve` held, counted on the device."""


def unpin_block_saves(invocations: list[Invocation], memo: dict[int, Any]) -> None:
    """Replace the saved views the blocks bound to names by copies (the copies are the saved values now)."""
    walk = SavedWalk(memo)
    for invocation in invocations:
        walk.block_saves(invocation)
    walk.fill()


def unpin_client_saves(jobs: list[TraceJob], memo: dict[int, Any], walked: dict[int, Walked] | None = None) -> None:
    """Replace the views inside the containers the trace bodies saved (which their blocks fill) by copies."""
    walk = SavedWalk(memo)
    for job in jobs:
        walk.lists = {} if walked is None else walked.setdefault(id(job), {})
        walk.client_saves(job)
    walk.fill()


class SavedWalk:
    """One pass over saved values: views become copies (`copies`), and each tensor goes through `counter`.

    Copies: a view that carries autograd state is cloned on the spot (the clone joins the graph, see
    `carry_grad`); every other is given an empty tensor of its shape and strides (as `clone` would
    make) at once, and the pass copies into all of them with one `torch._foreach_copy_` (`fill`): on a
    GPU, one launch per step rather than one per saved value. A saved list that gained many plain views
    since the last pass (every request's read of every layer) has them copied by one
    `torch._foreach_clone` of their own (`_copy_new_views`): the same copies, allocated in C++. The
    copies never share storage: each request's saved values are its own. `memo` (id of a value -> what
    it became) gives a value held in two places one copy, counted once.

    `counter` (None: nothing counted) decides where each saved tensor not counted yet is kept: the
    walk hands it the view and its own copy function, so a value the counter moves to the host is
    copied once, straight there. A counted tensor is never a view, except where the walk does not
    copy (`copies=False`: the ledger on its own counts values as they are).

    A list a trace saves grows every step (`saved.append(layer.output)` under `tracer.all()`) and is
    walked every step. `lists` (the current job's) remembers, per list, its first items as the last
    pass left them, when those were all settled (plain tensors, owning their memory where the walk
    copies, counted where it counts: at later steps they stay so): if the list still starts with the
    very same objects (one identity comparison per item, in C), only the items after them are visited
    in Python. An item deleted or replaced below that end breaks the comparison, and the list is
    walked whole again. The pass still compares that prefix (its record only grows by the new items),
    so it stays linear in what the trace holds, at about 20 ns per item rather than the Python walk's.
    """

    def __init__(self, memo: dict[int, Any], counter: Counter | None = None, copies: bool = True) -> None:
        self.memo = memo
        self.counter = counter
        self.copies = copies
        self.lists: Walked = {}
        self._views: list[torch.Tensor] = []  # the views to copy ...
        self._copies: list[torch.Tensor] = []  # ... into these (same shapes), at `fill`

    def block_saves(self, invocation: Invocation) -> None:
        """Walk the values an invocation's block bound with `.save()`; a new one is bound in place of the old."""
        saved = saved_value_ids()
        scope = invocation.mediator.lcls
        # id of a saved value -> what is saved in its place, marked saved after the loop: a value bound to two
        # names is found saved under both
        replaced: dict[int, Any] = {}
        for name in list(scope.written):
            value = scope.get(name)
            if id(value) not in saved:
                continue
            result = self.map(value)
            if result is not value:
                scope[name] = result
                replaced[id(value)] = result
        for value_id, result in replaced.items():
            saved.discard(value_id)
            saved.add(id(result))

    def client_saves(self, job: TraceJob) -> None:
        """Walk the containers (and values) a job's trace body saved, which its blocks fill."""
        for value in job.client_saves:
            self.map(value)

    def fill(self) -> None:
        """Copy every view of the pass into its new tensor (before anyone can read the copies)."""
        if self._views:
            torch._foreach_copy_(self._copies, self._views)
            self._views, self._copies = [], []

    def map(self, value: Any) -> Any:
        """`value` with each tensor copied and counted as the walk does (lists and dicts edited in place).

        Called at the end of each step, when no block can still edit a view in place.
        """
        memo = self.memo
        key = id(value)
        if key in memo:
            return memo[key]
        memo[key] = value
        if isinstance(value, torch.Tensor):
            result = self._tensor(value)
        elif isinstance(value, list):
            self._map_items(value)
            result = value
        elif isinstance(value, dict):
            for name in list(value):
                value[name] = self.map(value[name])
            result = value
        elif isinstance(value, tuple):
            items = [self.map(item) for item in value]
            if all(new is old for new, old in zip(items, value)):
                result = value
            else:
                result = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        else:
            result = value
        memo[key] = result
        return result

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.counter is not None:
            return self.counter.count(tensor, self._copy if self.copies else None)
        return self._copy(tensor) if self.copies and tensor._base is not None else tensor

    def _copy(self, view: torch.Tensor) -> torch.Tensor:
        if type(view) is not torch.Tensor or view.requires_grad:
            copy = view.clone()
            carry_grad(view, copy)
            return copy
        copy = torch.empty_like(view)  # view's shape and strides, as `clone` keeps them
        self._views.append(view)
        self._copies.append(copy)
        return copy

    def _map_items(self, items: list) -> None:
        """`map` each item of a list in place, from the first one the last pass did not leave settled."""
        start = self._settled_prefix(items)
        if self._copy_new_views(items, start):
            return
        settled = True  # whether items[:index] are all settled
        end = len(items)
        copies, plain = self.copies, self.counter is None
        for index in range(start, len(items)):
            item = items[index]
            if plain and type(item) is torch.Tensor and (item._base is None or not copies):
                continue  # (the common case, without `map`'s dispatch: a copy, or nothing to do)
            result = self.map(item)
            if settled and not (type(result) is torch.Tensor and (result._base is None or not copies)):
                settled, end = False, index  # (a container is walked again every pass: it may change)
            if result is not item:
                items[index] = result
        self._settle(items, start, end)

    def _settled_prefix(self, items: list) -> int:
        """How many of the list's first items the last pass left settled and are still the very same objects."""
        known = self.lists.get(id(items))
        if known is not None and known[0] is items and len(known[1]) <= len(items) and all(map(is_, items, known[1])):
            return len(known[1])  # (`map` stops at the shorter: the known items are compared)
        return 0

    def _settle(self, items: list, start: int, end: int) -> None:
        """`items[:end]` are settled now; the known prefix, `items[:start]`, is extended rather than copied again."""
        known = self.lists.get(id(items)) if start else None
        if known is not None and known[0] is items and len(known[1]) == start:
            known[1].extend(items[start:end])
        else:
            self.lists[id(items)] = (items, items[:end])

    def _copy_new_views(self, items: list, start: int) -> bool:
        """`_map_items`'s common case in one go: the items from `start` on are distinct plain views without
        autograd state, met nowhere else this pass (`saved.append(layer.output)` every step), which all stay
        on the device; False otherwise.

        Each gets a copy of its own, as `_copy` gives it: made by one `torch._foreach_clone` when the list
        gained at least `MIN_CLONED_TOGETHER` of them (the allocations in C++, and one copy launch on a GPU),
        else joining the pass's copies (`fill`).
        """
        tail = items[start:]
        if not self.copies or not tail:
            return False
        if not all(type(t) is torch.Tensor and t._base is not None and not t.requires_grad for t in tail):
            return False
        ids = list(map(id, tail))
        memo = self.memo
        if not memo.keys().isdisjoint(ids) or len(set(ids)) != len(ids):
            return False
        sizes = None if self.counter is None else self.counter.reserve(tail)
        if self.counter is not None and sizes is None:
            return False  # some go elsewhere: one at a time
        if len(tail) >= MIN_CLONED_TOGETHER:
            copied = torch._foreach_clone(tail)  # each view's shape and strides, as `clone` keeps them
        else:
            copied = [self._copy(view) for view in tail]  # (filled with the pass's other copies)
        if sizes is not None:
            self.counter.record(copied, sizes)
        memo.update(zip(ids, copied))
        items[start:] = copied
        self._settle(items, start, len(items))  # (the copies own their memory, as the known prefix does)
        return True


# A list's new views copied by one `_foreach_clone` of their own from this many on (fewer join the pass's copy).
MIN_CLONED_TOGETHER = 8
