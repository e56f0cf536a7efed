"""`nnrun extract --ray --engines M --tensor-parallel-size N`: M Ray engines of N ranks each.

The oracle is the same job run in this one process over N local ranks: every file of the folder
(shards and manifest) must be the same bytes, and the values within fp32 noise of one device.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from ray_helpers import JOB, MODEL, MODULES, folder_hashes

import nnrun
from nnrun.cli import main as cli_main
from nnrun.distributed import RayExecutor
from nnrun.extract import SettingsMismatchError
from nnrun.tp import TensorParallelError
from tolerance import assert_close_packed

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TP2_JOB = {**JOB, "llm_kwargs": {**JOB["llm_kwargs"], "tensor_parallel_size": 2, "tensor_parallel_timeout": 60}}


@pytest.fixture(scope="module")
def local_tp_folder(tmp_path_factory, prompts_file) -> Path:
    """The job over two ranks spawned by this process (each rank 1 torch thread, as on the engines)."""
    out = tmp_path_factory.mktemp("local-tp2")
    assert nnrun.extract(MODEL, str(prompts_file), MODULES, out, **TP2_JOB).is_complete
    return out


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone too: it only waits for its parent to read it
        return stat.read().split(") ")[1].startswith("Z")


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all(_gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_command_runs_an_engine_of_two_ranks_and_writes_the_local_tp_folder(
    ray_address, prompts_file, local_tp_folder, tmp_path
):
    out = tmp_path / "ray-tp2"
    argv = ["extract", "--model", MODEL, "--input", str(prompts_file), "--module", *MODULES, "--out", str(out)]
    argv += [
        "--shard-tokens",
        str(JOB["shard_tokens"]),
        "--batch-tokens",
        str(JOB["llm_kwargs"]["max_num_batched_tokens"]),
    ]
    argv += ["--on-error", "skip", "--quiet", "--ray", ray_address, "--engines", "1", "--tensor-parallel-size", "2"]
    assert cli_main(argv) == 0  # accepted: --ray with --tensor-parallel-size is no longer refused
    assert folder_hashes(out) == folder_hashes(local_tp_folder)

    single = tmp_path / "local-tp1"
    nnrun.extract(MODEL, str(prompts_file), MODULES, single, **JOB)
    ours, theirs = nnrun.load_activations(out), nnrun.load_activations(single)
    assert ours.manifest.settings["tensor_parallel_size"] == 2 and len(ours) == len(theirs)
    for i in range(len(ours)):
        for name in MODULES:
            assert_close_packed(ours[i][name], theirs[i][name], msg=f"prompt {i} {name}")

    # The folder was written by two ranks: one device rounds differently, so it may not resume it.
    with pytest.raises(SettingsMismatchError, match="tensor_parallel_size"):
        nnrun.extract(MODEL, str(prompts_file), MODULES, out, executor="ray", **JOB)


def _kill_rank_before_the_first_range(killed: list[int]):
    """An `on_engines` callback: SIGKILL rank 1 of engine 0 once its group is up, before any range is sent."""
    import ray

    def on_engines(engines: list) -> None:
        pids = ray.get(engines[0].rank_pids.options(concurrency_group="control").remote(), timeout=120)
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        killed.extend(pids)

    return on_engines


def test_a_killed_rank_fails_its_range_and_ray_retries_it_on_a_new_group(
    ray_address, prompts_file, local_tp_folder, tmp_path
):
    import ray

    killed: list[int] = []
    seen: set[int] = set()  # every rank pid the engine reports while the job runs (the new group's too)
    is_done = threading.Event()

    def watch(engine) -> None:
        while not is_done.is_set():
            try:
                seen.update(ray.get(engine.rank_pids.options(concurrency_group="control").remote(), timeout=30))
            except ray.exceptions.RayError:
                return  # the job ended and the engine was killed
            time.sleep(0.1)

    def on_engines(engines: list) -> None:
        _kill_rank_before_the_first_range(killed)(engines)
        threading.Thread(target=watch, args=(engines[0],), daemon=True).start()

    executor = RayExecutor(num_engines=1, on_engines=on_engines)
    try:
        summary = nnrun.extract(MODEL, str(prompts_file), MODULES, tmp_path, executor=executor, **TP2_JOB)
    finally:
        is_done.set()
    assert summary.is_complete and killed
    assert folder_hashes(tmp_path) == folder_hashes(local_tp_folder)
    assert seen - set(killed), "the engine never reported its new group"
    assert _wait_gone([*killed, *seen])  # no rank outlives its engine


def test_a_killed_rank_without_retries_fails_the_job_naming_the_rank(ray_address, prompts_file, tmp_path):
    import ray

    killed: list[int] = []
    engines: list = []

    def on_engines(handles: list) -> None:
        engines.extend(handles)
        _kill_rank_before_the_first_range(killed)(handles)

    executor = RayExecutor(num_engines=1, max_task_retries=0, on_engines=on_engines)
    with pytest.raises(
        TensorParallelError,
        match=r"engine 0 failed range 0 after 0 retries .*rank 1 \(pid \d+\) was killed by signal SIGKILL",
    ):
        nnrun.extract(MODEL, str(prompts_file), MODULES, tmp_path, executor=executor, **TP2_JOB)
    assert _wait_gone(killed)  # the failed group's ranks, and the engine itself, are gone
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(engines[0].rank_pids.options(concurrency_group="control").remote(), timeout=60)


def test_an_engine_no_node_can_hold_is_refused_by_name(ray_address, tmp_path):
    executor = RayExecutor(num_engines=1, cpus_per_engine=2)  # 2 ranks x 2 slots; the test cluster's node has 2
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 holds 4 CPU on one node .*largest node .* has 2"):
        nnrun.extract(MODEL, ["a b"], MODULES, tmp_path, executor=executor, **TP2_JOB)


# Two engines of two ranks need 4 CPU slots: a cluster of its own in a driver process (this
# process is already connected to the session's 2-slot cluster).
TWO_BY_TWO = """
import sys, ray
sys.path.insert(0, {tests!r})
from ray_helpers import JOB, MODEL, MODULES
import nnrun
ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING", log_to_driver=False)
job = {{**JOB, "llm_kwargs": {{**JOB["llm_kwargs"], "tensor_parallel_size": 2, "tensor_parallel_timeout": 60}}}}
summary = nnrun.extract(MODEL, {prompts!r}, MODULES, {out!r}, executor="ray", num_engines=2, **job)
sys.exit(0 if summary.is_complete else 1)
"""


def test_two_engines_of_two_ranks_write_the_local_tp_folder(prompts_file, local_tp_folder, tmp_path):
    out = tmp_path / "ray-2x2"
    script = TWO_BY_TWO.format(tests=str(REPO / "tests" / "distributed"), prompts=str(prompts_file), out=str(out))
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert folder_hashes(out) == folder_hashes(local_tp_folder)
