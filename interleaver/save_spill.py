"""Saved values past the engine's device budget go to host memory; a trace past the host budget fails alone.

At the end of each watched step, `SavedValueLedger.copy_and_account` walks every saved value of the
step's traces once (`saved_copies.SavedWalk`): the names their blocks bound with `.save()` and the
containers their trace bodies saved (a list a block appends to every step). In that walk a saved view
becomes a copy, and a tensor the ledger has not seen is counted against the `SaveBudget`
(nnrun/save_budget.py): it stays on the device while the device budget lasts, and past it is
replaced, where it is held, by a host copy (pinned, copied with `non_blocking` on CUDA), made
straight from the view. The copies of a step are waited for (one CUDA event) before any block runs
again and before the trace's values go back to the caller. A counted tensor that dies (a name bound
again, an item deleted) is uncounted at the next pass (a weak reference reports it); a trace's bytes
are all released when it finishes, fails or is aborted (`release`).

A saved list grows every step (`saved.append(layer.output)` under `tracer.all()`): each pass looks
in Python only at the items after the prefix the last pass left settled, and only while the list
still starts with those very objects; an item deleted or replaced below that end makes the pass walk
the list whole (counted values are recognized, not counted again), so nothing held goes uncounted.

Values that carry autograd state stay on the device (a host copy would cut `.grad`), and are
counted there whatever the budget. A value moved to the host is a CPU tensor: a block that uses it
again in a later step on the GPU moves it back itself (`.to(device)`).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import torch

from interleaver.saved_copies import SavedWalk, Walked
from nnrun.config import CacheConfig
from nnrun.save_budget import SaveBudget, SaveBudgetError, saved_values_device_bytes, saved_values_host_bytes

if TYPE_CHECKING:
    from interleaver.jobs import Invocation, TraceJob


class Counted(weakref.ref):
    """A weak reference to a counted tensor, carrying where and how much it is counted.

    One object per saved tensor (the ledger's whole record of it): when the tensor dies, the ref itself
    is queued for `_uncount_dropped`.
    """

    __slots__ = ("key", "tensor_id", "on_host", "num_bytes")  # id(job), id(tensor), counted on the host, bytes


# id(tensor) -> its record
Placed = dict[int, Counted]


class SavedValueLedger:
    """Each running trace's saved tensors, counted against the engine's `SaveBudget` (engine thread only)."""

    def __init__(self, budget: SaveBudget, device: torch.device | str = "cpu") -> None:
        self.budget = budget
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"  # host copies are pinned and asynchronous
        self._placed: dict[int, Placed] = {}  # id(job) -> its counted tensors
        self._walked: dict[int, Walked] = {}  # id(job) -> how far its saved lists are settled (`SavedWalk`)
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
        """Count the jobs' saved values not counted yet, as they are (views too), moving those past the device
        budget to the host.

        Returns the jobs whose values fit in neither budget (they are to fail); their bytes stay counted
        until `release`.
        """
        walk = SavedWalk({}, copies=False)
        return self._walk_jobs(walk, [(job, [inv for inv in job.invocations if _is_pushed(inv)]) for job in jobs])

    def copy_and_account(self, invocations: list[Invocation]) -> dict[TraceJob, SaveBudgetError]:
        """The end of a watched step, in one walk: the saved views of the step's invocations (and inside their
        traces' saved containers) become copies, and the values not counted yet are counted (`account`).

        An edit's saves are copied, never counted (its names are never pushed), as are a finished invocation's.
        """
        walk = SavedWalk({})
        by_job: dict[int, tuple[TraceJob, list[Invocation]]] = {}
        for invocation in invocations:
            if _is_pushed(invocation):
                by_job.setdefault(id(invocation.job), (invocation.job, []))[1].append(invocation)
        failed = self._walk_jobs(walk, list(by_job.values()))
        walk.counter = None
        for invocation in invocations:  # (after the counted walk: a value an edit shares is counted there)
            if not _is_pushed(invocation):
                walk.lists = {}
                walk.block_saves(invocation)
        walk.fill()
        return failed

    def _walk_jobs(
        self, walk: SavedWalk, jobs: list[tuple[TraceJob, list[Invocation]]]
    ) -> dict[TraceJob, SaveBudgetError]:
        """Walk each job's saved values (its invocations' names, then its trace body's), counting them."""
        self._uncount_dropped()
        failed: dict[TraceJob, SaveBudgetError] = {}
        has_copies = False
        for job, invocations in jobs:
            counter = walk.counter = _Counter(self, id(job))
            walk.lists = self._walked.setdefault(id(job), {})
            try:
                _walk_job(walk, job, invocations)
            except SaveBudgetError as error:  # (the failing trace stays counted until `release`)
                failed[job] = error
                walk.counter, walk.lists = None, {}
                _walk_job(walk, job, invocations)  # its views are copied all the same
            has_copies |= counter.moved
        walk.fill()
        # A value deleted from a list dies only now, when the walk lets go of its record of the list's prefix.
        self._uncount_dropped()
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
        self._walked.pop(id(job), None)
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
    """One pass's counting of a job's saved tensors (`saved_copies.Counter`, for `SavedValueLedger`).

    `count` takes one tensor; `reserve` and `record` the views a saved list gained since the last pass
    (`saved.append(layer.output)` under `tracer.all()`: one per request, module and step), and when they
    are all plain device values that fit in the device budget together, count their copies with one
    sum instead of one budget call each (the same totals, where each would stay anyway).
    """

    def __init__(self, ledger: SavedValueLedger, key: int) -> None:
        self.ledger = ledger
        self.key = key
        self.placed = ledger._placed.setdefault(key, {})
        self.died = ledger._dropped.append
        self.moved = False  # whether some tensor went to the host

    def count(self, tensor: torch.Tensor, copy: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        """`tensor` counted: as is, `copy(tensor)` for a view, or its host copy past the device budget."""
        entry = self.placed.get(id(tensor))
        if entry is not None and entry() is tensor:
            return tensor
        ledger = self.ledger
        num_bytes = tensor.nbytes  # (a view's own elements, as its copy holds them)
        on_host = ledger._place(self.key, tensor, num_bytes)
        if on_host and (not tensor.is_cpu or not ledger.is_cuda):  # on CPU every value is the device's
            tensor = _to_host(tensor, ledger.is_cuda)
            self.moved = True
        elif copy is not None and tensor._base is not None:
            tensor = copy(tensor)
        self._record(tensor, on_host, num_bytes)
        return tensor

    def reserve(self, views: list[torch.Tensor]) -> list[int] | None:
        """The views' sizes, held on the device, if they all stay there together; else None (nothing held)."""
        ledger = self.ledger
        budget = ledger.budget
        if ledger.is_cuda and any(t.is_cpu for t in views):
            return None
        sizes = [t.nbytes for t in views]
        total = sum(sizes)
        if budget.device_bytes + total > budget.max_device_bytes:
            return None
        budget.hold(self.key, total, on_host=False)
        return sizes

    def record(self, copies: list[torch.Tensor], sizes: list[int]) -> None:
        """Records for the copies of the views `reserve` held."""
        placed, key, died = self.placed, self.key, self.died
        for tensor, num_bytes in zip(copies, sizes):  # (`_record`, inlined: once per saved value)
            entry = placed[id(tensor)] = Counted(tensor, died)
            entry.key, entry.tensor_id, entry.on_host, entry.num_bytes = key, id(tensor), False, num_bytes

    def _record(self, tensor: torch.Tensor, on_host: bool, num_bytes: int) -> None:
        entry = self.placed[id(tensor)] = Counted(tensor, self.died)
        entry.key, entry.tensor_id, entry.on_host, entry.num_bytes = self.key, id(tensor), on_host, num_bytes


def _to_host(tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    """A compact host copy of `tensor`, pinned and copied asynchronously on CUDA (wait before reading)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin_memory)  # tensor's shape
    host.copy_(tensor, non_blocking=pin_memory)
    return host


def _is_pushed(invocation: Invocation) -> bool:
    """Whether an invocation's saves still go back to its caller (an edit's never do; a finished one's went)."""
    return not (invocation.is_edit or invocation.is_finished)


def _walk_job(walk: SavedWalk, job: TraceJob, invocations: list[Invocation]) -> None:
    for invocation in invocations:
        walk.block_saves(invocation)
    walk.client_saves(job)
