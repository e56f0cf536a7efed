"""An interrupted block leaves the interpreter as it found it.

The engine stops a block that loops by raising an asynchronous exception on its thread
(`interleaver.block_interrupt`). Retracting one with `PyThreadState_SetAsyncExc(thread, NULL)`
left CPython 3.11's "async exception pending" flag set for good: from then on, any Python
function called under a trace function (a debugger, coverage, nnsight's own `skip_context`)
spun forever on its first instruction. Each case runs in its own process, bounded in time, and
ends by calling a function under `sys.settrace`: it hangs if the flag was left set.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each case runs in a fresh interpreter

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 120

CALL_UNDER_A_TRACE_FUNCTION = """
def plain():
    return 1

sys.settrace(lambda *args: None)
plain()
sys.settrace(None)
print("call under a trace function returned", flush=True)
"""


def run_bounded(script: str) -> str:
    body = textwrap.dedent(script) + CALL_UNDER_A_TRACE_FUNCTION
    completed = subprocess.run([sys.executable, "-c", body], cwd=REPO, capture_output=True, text=True, timeout=BOUND_S)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "call under a trace function returned" in completed.stdout, completed.stdout
    return completed.stdout


def test_an_interrupt_that_lands_in_the_block_leaves_no_pending_flag():
    out = run_bounded("""
        import sys, threading, time
        from interleaver.block_interrupt import BlockCancelled, RunningBlocks

        blocks, mediator, started, outcome = RunningBlocks(), object(), threading.Event(), []

        def engine_thread():
            blocks.enter(mediator)
            try:
                started.set()
                while True:  # the block loops until it is interrupted
                    pass
            except BlockCancelled:
                outcome.append("cancelled in the block")
            finally:
                blocks.leave(mediator)

        thread = threading.Thread(target=engine_thread)
        thread.start()
        started.wait(30)
        time.sleep(0.05)
        assert blocks.interrupt([mediator])
        thread.join(30)
        assert not thread.is_alive()
        assert blocks._stack == [] and blocks._interrupted == set()
        print(outcome, flush=True)
    """)
    assert "['cancelled in the block']" in out


def test_an_interrupt_sent_as_the_block_parks_lands_in_leave_and_nowhere_later():
    """The engine thread is already in `leave` (waiting on the lock the interrupt holds) when it is sent."""
    out = run_bounded("""
        import sys, threading, time
        from interleaver import block_interrupt
        from interleaver.block_interrupt import BlockCancelled, RunningBlocks

        blocks, mediator, outcome = RunningBlocks(), object(), []
        blocks._lock.acquire()  # as interrupt() holds it while it sends
        blocks._stack.append(mediator)

        def engine_thread():
            blocks._thread_id = threading.get_ident()
            try:
                try:
                    blocks.leave(mediator)  # the block parked; waits on the lock
                finally:
                    outcome.append("left")
            except BlockCancelled:
                blocks.leave(mediator)  # what the mediator's handler does
                outcome.append("cancelled in leave")
            for _ in range(1000):  # later code: nothing lands here
                time.sleep(0)
            outcome.append("went on")

        thread = threading.Thread(target=engine_thread)
        thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the engine thread waits on the lock, inside leave()
            frame = sys._current_frames().get(thread.ident)
            if frame is not None and frame.f_code.co_name == "leave":
                break
            time.sleep(0.01)
        time.sleep(0.05)
        blocks._interrupted.add(id(mediator))
        block_interrupt._set_async_exception(blocks._thread_id, BlockCancelled)
        blocks._lock.release()
        thread.join(30)
        assert not thread.is_alive()
        assert blocks._stack == [] and blocks._interrupted == set()
        print(outcome, flush=True)
    """)
    assert "'went on'" in out
    assert "'cancelled in leave'" in out or "['left', 'went on']" in out  # landed in leave, or absorbed there


def test_ctrl_c_on_a_looping_trace_then_a_debugger_and_another_trace():
    """A user's view: Ctrl-C a trace whose block loops, trace again, then run code under a debugger's trace function."""
    run_bounded("""
        import os, signal, sys, threading, time
        import nnrun

        model = nnrun.LanguageModel("tiny-facts")

        def press_ctrl_c():
            deadline = time.monotonic() + 30
            while model.engine.num_requests_in_flight == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=press_ctrl_c, daemon=True).start()
        try:
            with model.trace("The Louvre is in"):
                hidden = model.model.layers[1].output
                while True:
                    hidden = hidden + 0
        except KeyboardInterrupt:
            print("interrupted", flush=True)

        with model.trace("The Louvre is in"):
            saved = model.model.layers[1].output.save()
        assert saved.shape[0] == 1
        model.shutdown()
    """)
