"""`nnrun serve --tensor-parallel-size 2`: client processes get one rank's results; a dead rank ends the server.

The reference is the same workloads (tests/serve/workloads.py) on an in-process one-rank
`nnrun.LanguageModel("tiny-facts")`: two ranks sum row-parallel projections in two halves, so
values agree to fp32 rounding (1e-5), greedy tokens exactly.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from serve_helpers import API_KEY, ServerProcess
from workloads import run_local

import nnrun

pytestmark = pytest.mark.slow

GROUPS = [["logits", "layers", "intervention", "invokes", "shared_list"], ["patching", "attention", "generation"]]
EXIT_WITHIN_S = 30


@pytest.fixture(scope="module")
def tp_server():
    process = ServerProcess("--tensor-parallel-size", "2", "--max-new-tokens", "64", "--request-timeout", "120")
    try:
        yield process.wait_ready(timeout=180)
    finally:
        process.stop()


def _rank_pids(server: ServerProcess) -> list[int]:
    """The server's rank processes (spawned children running multiprocessing's spawn main, not its resource tracker)."""
    children = []
    for task in Path(f"/proc/{server.process.pid}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    ranks = []
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            ranks.append(pid)
    return sorted(ranks)


def test_two_clients_get_one_rank_s_results(tp_server, clients, local_model, tmp_path):
    started = [clients(tp_server.url, group, tmp_path / f"client{i}.pt") for i, group in enumerate(GROUPS)]
    expected = run_local(local_model, [name for group in GROUPS for name in group])
    for client, group in zip(started, GROUPS):
        results = client.result()
        for name in group:
            got = results[name]
            assert "error" not in got, f"{name} failed on the server: {got.get('error')}"
            for key in expected[name]:
                torch.testing.assert_close(got[key], expected[name][key], atol=1e-5, rtol=1e-5, msg=f"{name}: {key}")
    assert tp_server.is_healthy()


def test_registered_edits_are_refused_by_name(tp_server):
    model = nnrun.LanguageModel("tiny-facts", serve=tp_server.url, api_key=API_KEY)
    with pytest.raises(Exception, match="registered edits are not served on tensor-parallel ranks"):
        with model.register() as (tracer, edit):
            model.model.layers[0].output[:] *= 2


def test_a_killed_rank_makes_the_server_unhealthy_and_exit_non_zero():
    server = ServerProcess("--tensor-parallel-size", "2").wait_ready(timeout=180)
    try:
        ranks = _rank_pids(server)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        model = nnrun.LanguageModel("tiny-facts", serve=server.url, api_key=API_KEY)
        with pytest.raises(Exception, match="rank 1 .* killed by signal SIGKILL"):
            with model.trace("The Eiffel Tower is in"):
                model.lm_head.output.save()
        deadline = time.monotonic() + EXIT_WITHIN_S
        saw_503 = False
        while server.process.poll() is None and time.monotonic() < deadline:
            try:
                saw_503 = saw_503 or httpx.get(f"{server.url}/health", timeout=2.0).status_code == 503
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert server.process.poll() == 3, server.output()
        assert saw_503
        assert all(
            not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
            for pid in ranks
        )
    finally:
        server.stop()
