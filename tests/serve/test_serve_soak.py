"""Soak: 16 innocent client processes share a server while one hostile process sends garbage, slowloris
connections, stalled bodies, huge headers and bad payloads; every innocent result equals in-process.

Four innocent clients run nnsight traces (`run_client.py`), twelve run OpenAI completions over plain HTTP
(`openai_client.py`): a trace client imports torch and takes seconds of CPU to start, which sixteen of them on
a two-core machine would spend before the soak begins.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import torch
from serve_helpers import API_KEY, HERE, REPO, ServerProcess, child_env
from workloads import PROMPTS, run_local

import nnrun

pytestmark = pytest.mark.slow

NUM_TRACE_CLIENTS = 4
NUM_OPENAI_CLIENTS = 12
TRACE_WORKLOADS = [["logits", "intervention"], ["invokes", "generation"], ["layers", "patching"], ["attention"]]
MAX_TOKENS = 8
SOAK_LIMIT_S = 50.0  # the whole soak, the clients' start-up included


def start(script: str, spec: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / script), json.dumps(spec)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(process: subprocess.Popen, deadline: float) -> str:
    try:
        output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate(timeout=15)
        raise AssertionError(f"a client did not finish within the soak's {SOAK_LIMIT_S} s:\n{output}") from None
    assert process.returncode == 0, output
    return output


def test_innocent_clients_are_exact_while_a_hostile_one_attacks(clients, tmp_path, local_model):
    server = ServerProcess(
        "--header-timeout",
        "2",
        "--body-timeout",
        "2",
        "--block-timeout",
        "2",
        "--max-in-flight",
        "48",
        "--max-new-tokens",
        "16",
    ).wait_ready()
    address = {"host": "127.0.0.1", "port": server.port, "api_key": API_KEY}
    stop_file = tmp_path / "stop"
    hostile = start("hostile_client.py", {**address, "seconds": SOAK_LIMIT_S, "stop_file": str(stop_file)})
    started = time.monotonic()
    deadline = started + SOAK_LIMIT_S
    openai_clients = []
    try:
        time.sleep(1.0)  # the attack is under way before any innocent client connects
        traced = [clients(server.url, TRACE_WORKLOADS[i], tmp_path / f"traces{i}.pt") for i in range(NUM_TRACE_CLIENTS)]
        for i in range(NUM_OPENAI_CLIENTS):
            out = tmp_path / f"openai{i}.json"
            prompts = [PROMPTS[(i + k) % len(PROMPTS)] for k in range(2)]
            openai_clients.append(
                (
                    start(
                        "openai_client.py", {**address, "prompts": prompts, "max_tokens": MAX_TOKENS, "out": str(out)}
                    ),
                    out,
                )
            )

        expected_traces = run_local(local_model, sorted({name for group in TRACE_WORKLOADS for name in group}))
        params = nnrun.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        expected_texts = {prompt: local_model.engine.generate(prompt, params)[0].outputs[0].text for prompt in PROMPTS}
        for i, (process, out) in enumerate(openai_clients):
            finish(process, deadline)
            for prompt, texts in json.loads(out.read_text()).items():
                assert texts == [expected_texts[prompt]] * 2, (i, prompt, texts)
        for i, client in enumerate(traced):
            results = client.result(timeout=max(1.0, deadline - time.monotonic()))
            for name in TRACE_WORKLOADS[i]:
                assert "error" not in results[name], f"trace client {i}: {name} failed: {results[name]['error']}"
                for key in expected_traces[name]:
                    # Batched with other clients' traces vs alone: the same kernels, one torch thread each.
                    torch.testing.assert_close(
                        results[name][key],
                        expected_traces[name][key],
                        atol=1e-5,
                        rtol=1e-5,
                        msg=f"trace client {i}: {name}.{key}",
                    )
        stop_file.touch()
        sent = json.loads(finish(hostile, time.monotonic() + 15).strip().splitlines()[-1])
        assert all(count > 0 for count in sent.values()), sent  # every kind of attack ran during the soak
        assert time.monotonic() - started < SOAK_LIMIT_S
        stats = httpx.get(f"{server.url}/health", timeout=10).json()
        assert stats["requests_in_flight"] == 0 and stats["kv_pages_used"] == 0, stats
    finally:
        for process in [hostile] + [process for process, _ in openai_clients]:
            if process.poll() is None:
                process.kill()
                process.communicate(timeout=15)
        server.stop()
