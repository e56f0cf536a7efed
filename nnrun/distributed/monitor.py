"""The driver's view of running ranges between their ends: polls of each busy engine's forward counts.

An engine counts prompts and tokens after every forward in its own process (RangeProgress); the
driver asks for those counts at most every `interval_s` per engine, on the actor's control thread,
so a range moves the bars as its forwards finish, not only when its rows come back. A poll is one
small actor call and never blocks the driver: its reply is waited on with the ranges' own refs.
"""

from __future__ import annotations

import time
from typing import Any

from nnrun.distributed.progress import EngineProgress


class EngineMonitor:
    """Ask busy engines how far their range is, and hand the answers to the job's progress."""

    def __init__(self, engines: list[Any], progress: EngineProgress, interval_s: float) -> None:
        self.engines = engines
        self.progress = progress
        self.interval_s = interval_s
        self._polls: dict[Any, int] = {}  # ref of an unanswered poll -> engine; one at a time per engine
        self._last_poll = [0.0] * len(engines)

    def poll(self, busy_engines: list[int]) -> None:
        """Send a poll to each busy engine whose last one was answered and is `interval_s` old."""
        if not self.progress.enabled:
            return  # nothing shows the counts: no calls at all
        now = time.monotonic()
        waiting = set(self._polls.values())
        for engine in busy_engines:
            if engine not in waiting and now - self._last_poll[engine] >= self.interval_s:
                self._last_poll[engine] = now
                ref = self.engines[engine].progress.options(concurrency_group="control").remote()
                self._polls[ref] = engine

    @property
    def wait_timeout_s(self) -> float | None:
        """How long the driver may wait on the ranges before the next poll is due; None: no polls, wait for a range."""
        return self.interval_s if self.progress.enabled else None

    @property
    def refs(self) -> list[Any]:
        """Unanswered polls, to wait on alongside the ranges."""
        return list(self._polls)

    def take(self, ready: list[Any]) -> None:
        """Count the answered polls among `ready` (refs that are not polls are left alone)."""
        import ray

        for ref in ready:
            engine = self._polls.pop(ref, None)
            if engine is None:
                continue
            try:
                answer = ray.get(ref)
            except ray.exceptions.RayError:
                continue  # the engine died; Ray restarts it and the range's own ref says what became of it
            if answer is not None:
                self.progress.range_progress(engine, answer.number, answer.num_prompts, answer.num_tokens)
