"""A rank that dies or hangs fails every waiting caller within a bounded time; nothing is left behind."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from nnrun import LLM, SamplingParams
from nnrun.tp import TensorParallelError, wire

pytestmark = pytest.mark.slow

LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


def _port_is_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone too: it only waits for its parent to read it
        return stat.read().split(") ")[1].startswith("Z")


def _wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_killed_rank_fails_every_waiting_caller_and_shutdown_leaves_nothing():
    llm = LLM("tiny-facts", tensor_parallel_size=2, tensor_parallel_timeout=60)
    group = llm.runner.group
    pids, port = [p.pid for p in group.processes], group._store.port
    assert llm.generate("Water boils at", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    handles = [llm.submit(prompt, LONG) for prompt in ("a b c", "d e f", "g h i")]
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    for handle in handles:
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by signal SIGKILL"):
            handle.result(timeout=30)
    assert time.monotonic() - start < 30
    with pytest.raises(TensorParallelError, match="group has stopped: tensor-parallel rank 1"):
        llm.generate("Water boils at", SamplingParams(max_tokens=2))
    assert llm.shutdown(timeout=30)
    assert _wait_gone(pids, 10)
    assert _port_is_closed(port)


def test_a_rank_that_raises_reports_its_traceback_and_ends_the_group():
    llm = LLM("tiny-facts", tensor_parallel_size=2, tensor_parallel_timeout=60)
    try:
        # A step header promising 5 tokens with no arrays behind it: every rank fails to read it.
        malformed = np.array([wire.MessageKind.STEP, 0, 5, 1, 1, 1], dtype=np.int64).tobytes()
        with pytest.raises(TensorParallelError, match=r"rank \d failed while running a step:\nTraceback"):
            with llm.runner.step_lock:
                llm.runner.group.run_step(memoryview(malformed))
        with pytest.raises(TensorParallelError, match="group has stopped: tensor-parallel rank"):
            llm.generate("Water boils at", SamplingParams(max_tokens=2))
    finally:
        assert llm.shutdown(timeout=30)


# A decode step of one request, and a prefill of 75 x 120 tokens whose step message (about 220 KB)
# is larger than the pipe's socket buffer: sending it to a rank that stopped reading would block.
HUNG_STEPS = {"small": ["Water boils at"], "larger than the pipe buffer": [[5] * 120] * 75}


@pytest.mark.parametrize("step", list(HUNG_STEPS))
def test_a_hung_rank_is_reported_after_the_timeout(step):
    llm = LLM("tiny-facts", tensor_parallel_size=2, tensor_parallel_timeout=8, max_num_batched_tokens=16384)
    pids = [p.pid for p in llm.runner.group.processes]
    try:
        assert llm.generate("Water boils at", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
        os.kill(pids[1], signal.SIGSTOP)  # alive, silent: rank 0 waits in its next collective
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="8 s .*hung"):
            llm.generate(HUNG_STEPS[step], SamplingParams(max_tokens=4))
        assert time.monotonic() - start < 8 + 10
        assert _wait_gone(pids, 10)  # a stopped rank is killed too
    finally:
        llm.shutdown(timeout=30)


CTRL_C_SCRIPT = textwrap.dedent("""
    import sys
    from nnrun import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM("tiny-facts", tensor_parallel_size=2, tensor_parallel_timeout=60)
        print(*[p.pid for p in llm.runner.group.processes], flush=True)
        while True:
            llm.generate("Water boils at", SamplingParams(max_tokens=50, ignore_eos=True))
""")


def test_ctrl_c_in_the_front_end_stops_every_rank(tmp_path):
    script = tmp_path / "front_end.py"
    script.write_text(CTRL_C_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    front = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        pids = [int(pid) for pid in front.stdout.readline().split()]
        assert len(pids) == 2, front.stderr.read()
        time.sleep(1.0)  # in the middle of generating
        os.killpg(front.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole foreground group
        front.wait(timeout=60)
        stderr = front.stderr.read()
        assert "KeyboardInterrupt" in stderr
        assert "leaked" not in stderr  # no semaphore or shared-memory segment left to the resource tracker
        assert _wait_gone(pids, 15)
    finally:
        if front.poll() is None:
            os.killpg(front.pid, signal.SIGKILL)
            front.wait(10)
