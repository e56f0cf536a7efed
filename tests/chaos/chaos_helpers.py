"""Helpers of the chaos suite: solo oracles, co-scheduling requests into one step, leak checks."""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from greenlet import greenlet

import nnrun

WAIT_S = 60.0  # every wait in the suite is bounded


@dataclass
class TinyFacts:
    model: Any
    params: nnrun.SamplingParams
    _solo: dict = field(default_factory=dict)

    def solo(self, prompt: str) -> list[int]:
        """The oracle: greedy tokens of `prompt` run alone on an idle engine."""
        if prompt not in self._solo:
            self._solo[prompt] = self.model.engine.generate([prompt], self.params)[0].outputs[0].token_ids
        return self._solo[prompt]


def co_scheduled(engine: nnrun.LLM, callers: list[Callable[[], Any]], num_requests: int) -> list[Any]:
    """Run each caller on its own thread so that their `num_requests` requests enter one step together.

    Returns what each caller returned, or the BaseException it raised.
    """
    results: list[Any] = [None] * len(callers)

    def call(index: int) -> None:
        try:
            results[index] = callers[index]()
        except BaseException as error:  # the caller's own outcome, checked by the test
            results[index] = error

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(callers))]
    with engine.paused():
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + WAIT_S
        while engine.num_requests_in_flight < num_requests:
            assert time.monotonic() < deadline, "the callers did not submit their requests"
            time.sleep(0.005)
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive(), "a caller is still waiting on the engine"
    return results


def assert_clean(model: Any, threads_before: set[int]) -> None:
    engine = model.engine
    deadline = time.monotonic() + WAIT_S
    while engine.num_requests_in_flight or engine.core.has_unfinished:
        assert time.monotonic() < deadline, "requests are still in flight"
        time.sleep(0.01)
    with engine.runner.step_lock:
        engine.runner.allocator.check_no_leaks()
        helper = engine.runner.nnsight_requests
        assert not helper.live and not helper.request_to_invocations and not helper.step_invocations
        assert not engine.runner.interleaver.mediators
        assert not engine.runner._has_module_hooks()
    gc.collect()
    live = [g for g in gc.get_objects() if isinstance(g, greenlet) and g.parent is not None and bool(g)]
    assert not live, f"{len(live)} intervention greenlet(s) left alive"
    assert engine._thread is None or engine._thread.is_alive(), "the engine thread died"
    extra = [t for t in threading.enumerate() if t.ident not in threads_before and t is not engine._thread]
    assert not extra, f"threads left behind: {extra}"
