"""Fixtures of the distributed suite: one local Ray cluster for every test, and the single-process folder to match.

Ray start-up and each engine actor's start (a process importing torch and loading tiny-facts)
cost seconds, so the cluster lives for the whole session, on loopback, with no dashboard, and
is shut down at the end (no raylet or worker outlives the session).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from ray_helpers import BAD_LINES, JOB, MODEL, MODULES, NUM_THREADS, folder_hashes, job_prompts


@pytest.fixture(scope="session")
def ray_address():
    """The address of a local Ray cluster with 2 CPU slots, shared by the session's tests."""
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    ray.init(
        num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING", log_to_driver=False
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@contextmanager
def engine_thread_count():
    """Run this process's torch with the engines' thread count, so single-process bytes compare."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


@pytest.fixture(scope="module", autouse=True)
def engine_threads():
    with engine_thread_count():
        yield


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("input") / "prompts.txt"
    lines = job_prompts()
    for index in BAD_LINES:
        lines[index] = ""
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def reference(tmp_path_factory, prompts_file) -> dict[str, str]:
    """File hashes of the job run in this one process, with the engines' thread count."""
    from nnrun.extract import extract

    out = tmp_path_factory.mktemp("reference")
    with engine_thread_count():
        summary = extract(MODEL, str(prompts_file), MODULES, out, **JOB)
    assert summary.is_complete and summary.num_shards >= 12
    return folder_hashes(out)
