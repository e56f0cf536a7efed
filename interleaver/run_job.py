"""Running a trace's job on the engine: the one way both `LanguageModel` and `nnrun serve` do it.

The trace's requests are submitted as one gang (one step admits them all: invokes that share
values, and barriers, need their requests in the same forward), then the caller's thread waits
for the engine to finalize the job. Whatever ends the wait early (Ctrl-C, a streamer that raised,
a limit the caller's `check` raises) aborts the requests, freeing their KV, and interrupts a block
of theirs still running, which would otherwise hold the engine thread so the abort is never seen.
"""

from __future__ import annotations

from typing import Any, Callable

from interleaver.jobs import TraceJob


def run_trace_job(
    engine: Any,
    job: TraceJob,
    *,
    feed: Any = None,
    check: Callable[[], None] | None = None,
    poll_s: float = 1.0,
    abort_grace_s: float = 0.0,
    abort_with_error: bool = False,
) -> None:
    """Submit `job`'s requests as a gang and wait for it; `check()` runs every `poll_s` and may raise to end it.

    `feed`: an `interleaver.streaming.StreamerFeed` fed on this thread as tokens come.
    `abort_grace_s`: how long to wait, after an abort, for the engine to finalize the job (a server
    answers with the blocks' own errors when they come in time). `abort_with_error`: the aborted
    requests carry the error that ended the wait, not a plain abort.
    """
    handles = engine.submit_requests(list(job.requests.values()), gang=True, stream=feed is not None)
    try:
        if feed is not None:
            feed.follow(handles)
        while not job.done.wait(poll_s):
            if check is not None:
                check()
            if all(request.is_finished for request in job.requests.values()):
                with engine.runner.step_lock:  # a step that finished them has also finalized them
                    if not job.done.is_set():
                        raise RuntimeError("the engine finished this trace's requests without finalizing its blocks")
    except BaseException as error:
        engine.abort(list(job.requests), error if abort_with_error else None)
        engine.runner.interrupt_blocks([invocation.mediator for invocation in job.invocations])
        if abort_grace_s:
            job.done.wait(abort_grace_s)
        raise
