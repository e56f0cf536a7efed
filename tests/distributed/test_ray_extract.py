"""`nnrun.extract` on Ray engines: byte-identical to one process, through a killed engine and a killed driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ray_helpers import BAD_LINES, JOB, MODEL, MODULES, folder_hashes, job_prompts

from nnrun.distributed import RayExecutor
from nnrun.extract import InputError, extract
from nnrun.extract.manifest import Manifest

REPO = Path(__file__).resolve().parents[2]


def _num_committed(folder: Path) -> int:
    try:
        manifest = Manifest.load(folder)
    except ValueError:  # read while being replaced: cannot happen (os.replace), but never fail a poll on it
        return 0
    return len(manifest.shards) if manifest is not None else 0


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_two_engines_byte_identical(ray_address, prompts_file, reference, tmp_path):
    summary = extract(MODEL, str(prompts_file), MODULES, tmp_path, executor="ray", num_engines=2, **JOB)
    assert summary.is_complete and summary.num_skipped == len(BAD_LINES)
    assert summary.num_new_prompts == len(job_prompts()) - len(BAD_LINES)
    assert folder_hashes(tmp_path) == reference


def test_engine_killed_mid_range_is_restarted_by_ray(ray_address, prompts_file, reference, tmp_path):
    import ray

    engines: list = []
    executor = RayExecutor(num_engines=2, on_engines=engines.extend)
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(extract(MODEL, str(prompts_file), MODULES, tmp_path, executor=executor, **JOB))
        except BaseException as error:  # handed to the test thread
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        _wait_for(lambda: len(engines) == 2, 120, "the engines")

        def status():
            return ray.get(engines[1].status.options(concurrency_group="control").remote(), timeout=120)

        _wait_for(lambda: _num_committed(tmp_path) >= 1 and status()[1] is not None, 120, "a range on engine 1")
        killed_pid = status()[0]
        os.kill(killed_pid, signal.SIGKILL)
        new_pid, _ = status()  # answered by the restarted actor; the job cannot end before it redoes the range
        assert new_pid != killed_pid
    finally:
        thread.join(timeout=300)
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert outcome[0].is_complete
    assert folder_hashes(tmp_path) == reference


def test_killed_driver_resumes_byte_identical(ray_address, prompts_file, reference, tmp_path):
    out = tmp_path / "out"
    argv = [
        "extract",
        "--model",
        MODEL,
        "--input",
        str(prompts_file),
        "--module",
        *MODULES,
        "--out",
        str(out),
        "--shard-tokens",
        str(JOB["shard_tokens"]),
        "--batch-tokens",
        str(JOB["llm_kwargs"]["max_num_batched_tokens"]),
        "--on-error",
        "skip",
        "--ray",
        ray_address,
        "--engines",
        "2",
        "--quiet",
    ]
    log = tmp_path / "driver.log"
    with open(log, "wb") as stream:
        driver = subprocess.Popen(
            [sys.executable, "-c", "import sys; from nnrun.cli import main; sys.exit(main())", *argv],
            cwd=REPO,
            stdout=stream,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(lambda: _num_committed(out) >= 1 or driver.poll() is not None, 180, "the driver's first commit")
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    manifest = Manifest.load(out)
    assert manifest is not None and manifest.shards and not manifest.is_complete, log.read_text()[-2000:]

    from nnrun.cli import main

    assert main(argv) == 0  # the same command, in this process (already connected to the cluster)
    assert folder_hashes(out) == reference


def test_bad_item_stops_after_committing_what_came_before(ray_address, tmp_path):
    prompts = job_prompts(120)
    prompts[70] = ""
    job = {**JOB, "on_error": "stop"}  # the other tests skip bad items
    with pytest.raises(InputError, match="item 70: empty prompt"):
        extract(MODEL, prompts, MODULES, tmp_path / "ray", executor="ray", num_engines=2, **job)
    with pytest.raises(InputError, match="item 70: empty prompt"):
        extract(MODEL, prompts, MODULES, tmp_path / "local", **job)
    assert _num_committed(tmp_path / "ray") >= 2
    assert folder_hashes(tmp_path / "ray") == folder_hashes(tmp_path / "local")


def test_executor_arguments_are_checked():
    with pytest.raises(ValueError, match="executor must be"):
        extract(MODEL, ["a"], MODULES, "unused", executor="dask")
    with pytest.raises(ValueError, match="apply to executor='ray'"):
        extract(MODEL, ["a"], MODULES, "unused", num_engines=2)
    with pytest.raises(ValueError, match="num_engines must be positive"):
        RayExecutor(num_engines=0)
    from nnrun.cli import main

    argv = ["extract", "--model", MODEL, "--input", "p.txt", "--module", MODULES[0], "--out", "unused"]
    assert main([*argv, "--engines", "2"]) == 2  # a usage error: --engines without --ray
