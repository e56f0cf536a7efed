"""How long a rank spends in collectives over a window of steps, measured by torch's profiler.

Only while a window is open (`RankGroup.profile_collectives`): the profiler costs a few
microseconds per op, so it is never on for ordinary steps. A collective's time includes
waiting for the slowest peer to reach it, which is what a step loses to it.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

# CPU events gloo records per collective, and the names of NCCL's device kernels.
_CPU_COLLECTIVE_PREFIXES = ("gloo:",)
_DEVICE_COLLECTIVE_MARK = "nccl"


class CollectiveTimer:
    """One open profiling window on a rank."""

    def __init__(self, device: torch.device) -> None:
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self._profile.__enter__()
        self._started = time.perf_counter()

    def stop(self) -> dict[str, float]:
        """Close the window: its wall time, and the time and count of collectives in it."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - self._started
        self._profile.__exit__(None, None, None)
        collective_us, count = 0.0, 0
        for event in self._profile.events():
            if event.name.startswith(_CPU_COLLECTIVE_PREFIXES):
                collective_us += event.cpu_time_total
                count += 1
            elif _DEVICE_COLLECTIVE_MARK in event.name.lower() and event.device_time_total > 0:
                collective_us += event.device_time_total
                count += 1
        return {"wall_s": wall_s, "collective_s": collective_us / 1e6, "num_collectives": count}
