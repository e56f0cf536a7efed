"""Saved values past the engine's device budget go to host memory; a trace past the host budget fails alone.

At the end of each watched step (after `saved_copies.unpin_saves`), `SavedValueLedger.account` walks
every saved value of the step's traces: the names their blocks bound with `.save()` and the
containers their trace bodies saved (a list a block appends to every step). A tensor it has not
seen is counted against the `SaveBudget` (nnrun/save_budget.py): it stays where it is while the
device budget lasts, and past it is replaced, where it is held, by a host copy (pinned, copied
with `non_blocking` on CUDA). The copies of a step are waited for (one CUDA event) before any
block runs again and before the trace's values go back to the caller. A counted tensor that dies
(a name bound again) is uncounted at the next pass (a weak reference reports it); a trace's bytes
are all released when it finishes, fails or is aborted (`release`).

A saved list grows every step (`saved.append(layer.output)` under `tracer.all()`): each pass looks
only at the items appended since the last one, so a step costs what it saved, not what the trace
holds. (An item replaced in place below a list's previous end is not counted again.)

Values that carry autograd state stay on the device (a host copy would cut `.grad`), and are
counted there whatever the budget. A value moved to the host is a CPU tensor: a block that uses it
again in a later step on the GPU moves it back itself (`.to(device)`).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from interleaver.nnsight_private import saved_value_ids
from nnrun.config import CacheConfig
from nnrun.save_budget import SaveBudget, SaveBudgetError, saved_values_device_bytes, saved_values_host_bytes

if TYPE_CHECKING:
    from interleaver.jobs import TraceJob


class Counted(weakref.ref):
    """A weak reference to a counted tensor, carrying where and how much it is counted.

    One object per saved tensor (the ledger's whole record of it): when the tensor dies, the ref itself
    is queued for `_uncount_dropped`.
    """

    __slots__ = ("key", "tensor_id", "on_host", "num_bytes")  # id(job), id(tensor), counted on the host, bytes


# id(tensor) -> its record
Placed = dict[int, Counted]
# id(list) -> (the list, how many of its items were walked)
Scanned = dict[int, tuple[list, int]]


class SavedValueLedger:
    """Each running trace's saved tensors, counted against the engine's `SaveBudget` (engine thread only)."""

    def __init__(self, budget: SaveBudget, device: torch.device | str = "cpu") -> None:
        self.budget = budget
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"  # host copies are pinned and asynchronous
        self._placed: dict[int, Placed] = {}  # id(job) -> its counted tensors
        self._scanned: dict[int, Scanned] = {}  # id(job) -> its saved lists
        self._dropped: deque[Counted] = deque()  # the records of counted tensors that died
        self._copies_done: Any = None  # a CUDA event recorded after a step's host copies

    @classmethod
    def from_config(cls, cache: CacheConfig, device: torch.device) -> SavedValueLedger:
        """The ledger of an engine on `device`, with the budgets `cache` gives (or their defaults)."""
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        budget = SaveBudget(
            saved_values_device_bytes(cache.saved_values_device_bytes, total),
            saved_values_host_bytes(cache.saved_values_host_bytes),
        )
        return cls(budget, device)

    def account(self, jobs: list[TraceJob]) -> dict[TraceJob, SaveBudgetError]:
        """Count the jobs' saved values not counted yet, moving those past the device budget to the host.

        Returns the jobs whose values fit in neither budget (they are to fail); their bytes stay counted
        until `release`.
        """
        self._uncount_dropped()
        failed: dict[TraceJob, SaveBudgetError] = {}
        has_copies = False
        for job in jobs:
            try:
                has_copies |= self._account_job(job)
            except SaveBudgetError as error:
                failed[job] = error
        if has_copies and self.is_cuda:
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
        return failed

    def wait_copies(self) -> None:
        """Wait for the host copies made so far (before a block or the caller can read them)."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def release(self, job: TraceJob) -> None:
        """Forget a trace's saved values: it finished, failed or was aborted."""
        self._placed.pop(id(job), None)
        self._scanned.pop(id(job), None)
        self.budget.clear(id(job))

    def _uncount_dropped(self) -> None:
        """Uncount the tensors that died since the last pass (their weak references queued them, on any thread)."""
        dropped = self._dropped
        while dropped:
            ref = dropped.popleft()
            placed = self._placed.get(ref.key)
            if placed is not None and placed.get(ref.tensor_id) is ref:
                del placed[ref.tensor_id]
                self.budget.hold(ref.key, -ref.num_bytes, ref.on_host)

    def _account_job(self, job: TraceJob) -> bool:
        """Count one job's new saved tensors; True if some went to the host."""
        counter = _Counter(self, id(job))
        # (a `SaveBudgetError` leaves the failing trace counted until `release`)
        _map_saved_values(job, _Walk(counter, self._scanned.setdefault(counter.key, {})))
        return counter.moved

    def _place(self, key: int, tensor: torch.Tensor, num_bytes: int) -> bool:
        """Where a new saved tensor is counted: True for the host (`SaveBudgetError` if it fits nowhere)."""
        if tensor.requires_grad:  # (so is every tensor with a `grad_fn`)
            self.budget.hold(key, num_bytes, on_host=False)
            return False
        if tensor.is_cpu and self.is_cuda:  # on CUDA, a value the block moved to the host itself
            self.budget.place_on_host(key, num_bytes)
            return True
        return self.budget.place(key, num_bytes)


class _Counter:
    """One pass's counting of a job's saved tensors (`SavedValueLedger._account_job`).

    `count` takes one tensor; `count_many` the tensors a saved list gained since the last pass
    (`saved.append(layer.output)` under `tracer.all()`: one per request, module and step), and when
    they are all plain device values that fit in the device budget together, counts them with one
    sum instead of one budget call each (the same totals, where each would stay anyway).
    """

    def __init__(self, ledger: SavedValueLedger, key: int) -> None:
        self.ledger = ledger
        self.key = key
        self.placed = ledger._placed.setdefault(key, {})
        self.died = ledger._dropped.append
        self.moved = False  # whether some tensor went to the host

    def count(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` counted (as is, or its host copy past the device budget)."""
        entry = self.placed.get(id(tensor))
        if entry is not None and entry() is tensor:
            return tensor
        ledger = self.ledger
        num_bytes = tensor.nbytes
        on_host = ledger._place(self.key, tensor, num_bytes)
        if on_host and (not tensor.is_cpu or not ledger.is_cuda):  # on CPU every value is the device's
            tensor = _to_host(tensor, ledger.is_cuda)
            self.moved = True
        self._record(tensor, on_host, num_bytes)
        return tensor

    def count_many(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`count` of each of `tensors` (distinct plain tensors), in order: `tensors` itself if each stays as it is."""
        placed, ledger = self.placed, self.ledger
        fresh = [t for t in tensors if (entry := placed.get(id(t))) is None or entry() is not t]
        if not fresh:
            return tensors
        budget = ledger.budget
        on_device = not any(t.requires_grad or (t.is_cpu and ledger.is_cuda) for t in fresh)
        sizes = [t.nbytes for t in fresh]
        total = sum(sizes)
        if not on_device or budget.device_bytes + total > budget.max_device_bytes:
            return [self.count(t) for t in tensors]  # one at a time: some go elsewhere
        key, died = self.key, self.died
        budget.hold(key, total, on_host=False)
        for tensor, num_bytes in zip(fresh, sizes):  # (`_record`, inlined: once per saved value)
            record = placed[id(tensor)] = Counted(tensor, died)
            record.key, record.tensor_id, record.on_host, record.num_bytes = key, id(tensor), False, num_bytes
        return tensors

    def _record(self, tensor: torch.Tensor, on_host: bool, num_bytes: int) -> None:
        record = self.placed[id(tensor)] = Counted(tensor, self.died)
        record.key, record.tensor_id, record.on_host, record.num_bytes = self.key, id(tensor), on_host, num_bytes


def _to_host(tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    """A compact host copy of `tensor`, pinned and copied asynchronously on CUDA (wait before reading)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin_memory)  # tensor's shape
    host.copy_(tensor, non_blocking=pin_memory)
    return host


def _map_saved_values(job: TraceJob, walk: _Walk) -> None:
    """Apply `walk.fn` to every tensor a job saved, putting what it returns where the tensor was held."""
    saved = saved_value_ids()
    for invocation in job.invocations:
        if invocation.is_edit or invocation.is_finished:  # an edit's names are never pushed
            continue
        scope = invocation.mediator.lcls
        for name in list(scope.written):
            value = scope.get(name)
            if id(value) not in saved:
                continue
            result = walk.map(value)
            if result is not value:
                scope[name] = result
                saved.discard(id(value))
                saved.add(id(result))
    for value in job.client_saves:
        walk.map(value)


class _Walk:
    """One pass over a job's saved values: `fn` for each tensor (which returns it as is once counted), `fn_many`
    for a list's new plain tensors at once."""

    def __init__(self, counter: _Counter, scanned: Scanned) -> None:
        self.fn = counter.count
        self.fn_many = counter.count_many
        self.scanned = scanned
        self.memo: dict[int, Any] = {}  # id of a value -> what it became (a value held twice is walked once)

    def map(self, value: Any) -> Any:
        """`value` with each tensor `t` replaced by `fn(t)` (lists and dicts edited in place)."""
        key = id(value)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = value
        if isinstance(value, torch.Tensor):
            result = self.fn(value)
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
        self.memo[key] = result
        return result

    def _map_items(self, items: list) -> None:
        """`map` the items of a list appended since the last pass, in place."""
        known = self.scanned.get(id(items))
        start = known[1] if known is not None and known[0] is items and known[1] <= len(items) else 0
        memo, tail = self.memo, items[start:]
        ids = list(map(id, tail))
        if all(type(t) is torch.Tensor for t in tail) and memo.keys().isdisjoint(ids) and len(set(ids)) == len(ids):
            # The common case (plain tensors, each met once in this pass), counted at once without `map`'s dispatch.
            mapped = self.fn_many(tail)
            memo.update(zip(ids, mapped))
            if mapped is not tail:
                items[start:] = mapped
        else:
            for index in range(start, len(items)):
                item = items[index]
                result = self.map(item)
                if result is not item:
                    items[index] = result
        self.scanned[id(items)] = (items, len(items))
