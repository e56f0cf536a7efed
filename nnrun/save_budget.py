"""The engine's budget for the values running traces save: so much on the device, then so much on the host.

Saved values live on the device, beside the KV pool, which is sized at start to fill the engine's
share of the card. So the KV sizing leaves `CacheConfig.saved_values_device_bytes` out of the pool,
and the saves of running traces may hold that much of the device; what comes beyond it goes to host
memory (pinned on CUDA), up to `CacheConfig.saved_values_host_bytes`. A trace whose saves fit in
neither fails alone with `SaveBudgetError`. Bytes are counted per trace (an opaque key) and
released when the trace ends, however it ends. CPU bookkeeping only: no device tensor is held here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

GiB = 1 << 30
DEFAULT_DEVICE_FRACTION = 0.05  # of the whole card, on CUDA, when saved_values_device_bytes is None
DEFAULT_HOST_FRACTION = 0.5  # of the machine's RAM, when saved_values_host_bytes is None


class SaveBudgetError(RuntimeError):
    """A trace's saved values fit in neither the device nor the host budget for saved values."""


def host_memory_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def saved_values_host_bytes(configured: int | None) -> int:
    """The host budget: as configured, or half the machine's RAM."""
    return configured if configured is not None else int(host_memory_bytes() * DEFAULT_HOST_FRACTION)


def saved_values_device_bytes(configured: int | None, device_total_bytes: int | None) -> int:
    """The device budget: as configured, else 5% of a CUDA card; on a host device (CPU), whose memory is
    the host's, the host budget's size (the saves then spill only past it)."""
    if configured is not None:
        return configured
    if device_total_bytes is not None:
        return int(device_total_bytes * DEFAULT_DEVICE_FRACTION)
    return saved_values_host_bytes(None)


@dataclass
class SaveBudget:
    """Bytes of saved values held per trace, on the device and on the host, against the two limits."""

    max_device_bytes: int
    max_host_bytes: int
    device_bytes: int = 0  # held by running traces on the device
    host_bytes: int = 0  # held by running traces in host memory
    _held: dict[int, list[int]] = field(default_factory=dict)  # trace key -> [device, host] bytes

    def clear(self, key: int) -> None:
        """Forget a trace's bytes (before they are counted again, or when it ends)."""
        held = self._held.pop(key, None)
        if held is not None:
            self.device_bytes -= held[0]
            self.host_bytes -= held[1]

    def hold(self, key: int, num_bytes: int, on_host: bool) -> None:
        """Count bytes a trace already holds where they are, whatever the limits."""
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = [0, 0]
        held[on_host] += num_bytes
        if on_host:
            self.host_bytes += num_bytes
        else:
            self.device_bytes += num_bytes

    def place(self, key: int, num_bytes: int) -> bool:
        """Count a new saved value: False if it stays on the device, True if it goes to the host.

        Raises `SaveBudgetError` if it fits in neither budget.
        """
        if self.device_bytes + num_bytes <= self.max_device_bytes:
            self.hold(key, num_bytes, on_host=False)
            return False
        self.place_on_host(key, num_bytes)
        return True

    def place_on_host(self, key: int, num_bytes: int) -> None:
        """Count a new saved value in host memory; raises `SaveBudgetError` if the host budget is full."""
        if self.host_bytes + num_bytes > self.max_host_bytes:
            raise SaveBudgetError(self._full_message(num_bytes))
        self.hold(key, num_bytes, on_host=True)

    def _full_message(self, num_bytes: int) -> str:
        return (
            f"this trace's saved values need {num_bytes} bytes ({num_bytes / GiB:.3f} GiB) more, but the budgets for saved values are "
            f"full: saved_values_device_bytes={self.max_device_bytes} ({self.device_bytes} in use) and "
            f"saved_values_host_bytes={self.max_host_bytes} ({self.host_bytes} in use by running traces). Raise "
            "saved_values_host_bytes (host memory, e.g. LLM(..., saved_values_host_bytes=64 << 30)) or "
            "saved_values_device_bytes (taken from the KV cache), or save less: a row instead of the whole "
            "sequence, fewer layers or steps."
        )

    @property
    def num_traces(self) -> int:
        return len(self._held)
