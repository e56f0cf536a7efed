"""Saved values past the engine's device budget go to host memory; a trace past the host budget fails alone.

At the end of each watched step (after `saved_copies.unpin_saves`), `SavedValueLedger.account` walks
every saved value of the step's traces: the names their blocks bound with `.save()` and the
containers their trace bodies saved (a list a block appends to every step). A tensor it has not
seen is counted against the `SaveBudget` (nnrun/save_budget.py): it stays where it is while the
device budget lasts, and past it is replaced, where it is held, by a host copy (pinned, copied
with `non_blocking` on CUDA). The copies of a step are waited for (one CUDA event) before any
block runs again and before the trace's values go back to the caller. A tensor dropped since the
last pass (a name bound again) is no longer counted; a trace's bytes are all released when it
finishes, fails or is aborted (`release`).

Values that carry autograd state stay on the device (a host copy would cut `.grad`), and are
counted there whatever the budget. A value moved to the host is a CPU tensor: a block that uses it
again in a later step on the GPU moves it back itself (`.to(device)`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from interleaver.nnsight_private import saved_value_ids
from nnrun.config import CacheConfig
from nnrun.save_budget import SaveBudget, SaveBudgetError, saved_values_device_bytes, saved_values_host_bytes

if TYPE_CHECKING:
    from interleaver.jobs import TraceJob

# id(tensor) -> (a weak reference to it, whether it is counted on the host, its bytes)
Placed = dict[int, tuple[weakref.ref, bool, int]]


class SavedValueLedger:
    """Each running trace's saved tensors, counted against the engine's `SaveBudget` (engine thread only)."""

    def __init__(self, budget: SaveBudget, device: torch.device | str = "cpu") -> None:
        self.budget = budget
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda"
        self._placed: dict[int, Placed] = {}  # id(job) -> its counted tensors
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
        failed: dict[TraceJob, SaveBudgetError] = {}
        has_copies = False
        for job in jobs:
            try:
                has_copies |= self._account_job(job)
            except SaveBudgetError as error:
                failed[job] = error
        if has_copies and self.pin_memory:
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
        self.budget.clear(id(job))

    def _account_job(self, job: TraceJob) -> bool:
        """Count one job's new saved tensors; True if some went to the host."""
        key = id(job)
        placed = self._placed.setdefault(key, {})
        seen: set[int] = set()
        moved = [False]

        def count(tensor: torch.Tensor) -> torch.Tensor:
            entry = placed.get(id(tensor))
            if entry is not None and entry[0]() is tensor:
                seen.add(id(tensor))
                return tensor
            if entry is not None:  # its id now names another tensor: the old one is gone
                self.budget.hold(key, -entry[2], entry[1])
            num_bytes = tensor.numel() * tensor.element_size()
            on_host = self._place(key, tensor, num_bytes)
            if on_host and (tensor.device.type != "cpu" or self.device.type == "cpu"):
                tensor = _to_host(tensor, self.pin_memory)
                moved[0] = True
            placed[id(tensor)] = (weakref.ref(tensor), on_host, num_bytes)
            seen.add(id(tensor))
            return tensor

        _map_saved_values(job, count)  # (a `SaveBudgetError` leaves the failing trace counted until `release`)
        for tensor_id in [tensor_id for tensor_id in placed if tensor_id not in seen]:  # dropped since the last pass
            _, on_host, num_bytes = placed.pop(tensor_id)
            self.budget.hold(key, -num_bytes, on_host)
        return moved[0]

    def _place(self, key: int, tensor: torch.Tensor, num_bytes: int) -> bool:
        """Where a new saved tensor is counted: True for the host (`SaveBudgetError` if it fits nowhere)."""
        if tensor.requires_grad or tensor.grad_fn is not None:
            self.budget.hold(key, num_bytes, on_host=False)
            return False
        if tensor.device.type == "cpu" and self.device.type != "cpu":  # the block moved it to the host itself
            self.budget.place_on_host(key, num_bytes)
            return True
        return self.budget.place(key, num_bytes)


def _to_host(tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    """A compact host copy of `tensor`, pinned and copied asynchronously on CUDA (wait before reading)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin_memory)  # tensor's shape
    host.copy_(tensor, non_blocking=pin_memory)
    return host


def _map_saved_values(job: TraceJob, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply `fn` to every tensor a job saved, putting what it returns where the tensor was held."""
    memo: dict[int, Any] = {}
    saved = saved_value_ids()
    for invocation in job.invocations:
        if invocation.is_edit or invocation.is_finished:  # an edit's names are never pushed
            continue
        scope = invocation.mediator.lcls
        for name in list(scope.written):
            value = scope.get(name)
            if id(value) not in saved:
                continue
            result = _map(value, fn, memo)
            if result is not value:
                scope[name] = result
                saved.discard(id(value))
                saved.add(id(result))
    for value in job.client_saves:
        _map(value, fn, memo)


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, Any]) -> Any:
    """`value` with each tensor `t` replaced by `fn(t)` (lists and dicts edited in place)."""
    key = id(value)
    if key in memo:
        return memo[key]
    memo[key] = value
    if isinstance(value, torch.Tensor):
        result = fn(value)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            mapped = _map(item, fn, memo)
            if mapped is not item:
                value[index] = mapped
        result = value
    elif isinstance(value, dict):
        for name in list(value):
            value[name] = _map(value[name], fn, memo)
        result = value
    elif isinstance(value, tuple):
        items = [_map(item, fn, memo) for item in value]
        if all(new is old for new, old in zip(items, value)):
            result = value
        else:
            result = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    else:
        result = value
    memo[key] = result
    return result
