"""A registered edit that never reaches a module, met by OpenAI completions: ended by the block timeout,
reported to its registrant and on /health, and the engine free again; SIGTERM stops a server whatever holds it.

References: local greedy generation (`nnrun.LLM.generate`) and a local trace, as in the other serve tests.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from serve_helpers import API_KEY, ServerProcess

import nnrun

pytestmark = pytest.mark.slow

PROMPT = "The Colosseum is in"
MAX_TOKENS = 6
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def register_loop(model, name: str):
    """An edit whose block loops once it has a layer's output: it never reaches another module."""
    with model.register(name=name) as (tracer, edit):
        hidden = model.model.layers[0].output
        while hidden is not None:
            pass
    return edit


def complete(url: str, stream: bool = False, timeout: float = 30.0) -> httpx.Response:
    body = {"model": "tiny-facts", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=timeout)


def health(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (stats := health(server))["requests_in_flight"] or stats["blocks_live"] or stats["kv_pages_used"]:
        assert time.monotonic() < deadline, f"the engine still holds work: {stats}"
        time.sleep(0.05)
    return stats


def test_a_looping_edit_on_completions_is_ended_reported_and_the_engine_serves_again(local_model):
    server = ServerProcess("--block-timeout", "1", "--request-timeout", "60", "--max-new-tokens", "64").wait_ready()
    model = nnrun.LanguageModel("tiny-facts", serve=server.url, api_key=API_KEY)
    try:
        edit = register_loop(model, "spin")
        started = time.monotonic()
        response = complete(server.url)
        took = time.monotonic() - started
        assert response.status_code == 500, response.text
        message = response.json()["error"]["message"]
        assert "registered edit 'spin'" in message and "taken off" in message
        assert took < 1 + 4, f"the block timeout is 1 s, the completion took {took:.1f} s"

        status = edit.status()
        assert status["status"] == "failed" and "without reaching the model" in status["error"]
        with pytest.warns(RuntimeWarning, match="already taken this edit off: the registered edit 'spin'"):
            edit.clear()
        stats = wait_idle(server)
        assert [failure["name"] for failure in stats["edits_failed"]] == ["spin"]
        assert stats["edits_installed"] == 0

        # The engine is free: a completion and a trace give what they give locally.
        expected = local_model.engine.generate(PROMPT, nnrun.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
        assert complete(server.url).json()["choices"][0]["text"] == expected.outputs[0].text
        with model.trace(PROMPT):
            served = model.lm_head.output.save()
        with local_model.trace(PROMPT):
            local = local_model.lm_head.output.save()
        torch.testing.assert_close(served, local, atol=1e-5, rtol=1e-5)

        # Streamed, the completion ends with an error event naming the edit, then [DONE].
        register_loop(model, "spin-again")
        streamed = complete(server.url, stream=True)
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert "registered edit 'spin-again'" in events[-2] and events[-1] == "data: [DONE]"
        wait_idle(server)
        assert complete(server.url).json()["choices"][0]["text"] == expected.outputs[0].text

        # Met by a trace, the same edit fails that trace and is taken off the same way.
        edit = register_loop(model, "spin-in-a-trace")
        with pytest.raises(TimeoutError, match="registered edit 'spin-in-a-trace'"):
            with model.trace(PROMPT):
                model.lm_head.output.save()
        assert edit.status()["status"] == "failed"
        with model.trace(PROMPT):
            again = model.lm_head.output.save()
        torch.testing.assert_close(again, local, atol=1e-5, rtol=1e-5)
    finally:
        model.shutdown()
        server.kill()


def test_sigterm_stops_a_server_whose_engine_an_edit_holds():
    """The block timeout is far away: only the drain can free the engine, and the process exits in time."""
    server = ServerProcess("--block-timeout", "120", "--drain-timeout", "2").wait_ready()
    model = nnrun.LanguageModel("tiny-facts", serve=server.url, api_key=API_KEY)
    answers: list[httpx.Response] = []
    try:
        register_loop(model, "spin")
        sender = threading.Thread(target=lambda: answers.append(complete(server.url)))
        sender.start()
        deadline = time.monotonic() + 30
        while health(server)["blocks_live"] == 0:
            assert time.monotonic() < deadline, "the completion never reached the edit"
            time.sleep(0.05)
        started = time.monotonic()
        server.process.terminate()
        status = server.process.wait(timeout=2 + 8)  # drain timeout, plus the engine's stop, plus slack
        assert time.monotonic() - started < 2 + 6
        assert status == 0, server.output()
        sender.join(timeout=10)
        assert answers and answers[0].status_code == 503
        assert "shutting down" in answers[0].json()["error"]["message"]
    finally:
        model.shutdown()
        server.kill()
