"""A client that disconnects is noticed within a fraction of a second on every OpenAI route, streamed or not:
its request is aborted, its KV pages freed, and the engine stops running forwards for it.
"""

from __future__ import annotations

import time

import httpx
import pytest
from serve_helpers import API_KEY, ServerProcess

import nnrun

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
NOTICED_WITHIN_S = 1.0  # the route looks every 0.25 s; the abort lands at the next step (0.1 s here)


@pytest.fixture(scope="module")
def slowed():
    """A server whose every request carries an edit that takes 0.1 s a step (parking each step)."""
    server = ServerProcess("--max-new-tokens", "64").wait_ready()
    model = nnrun.LanguageModel("tiny-facts", serve=server.url, api_key=API_KEY)
    try:
        with model.register(name="slow") as (tracer, edit):
            for step in tracer.all():
                time.sleep(0.1)
                model.model.layers[0].output[:, -1] += 0
        yield server
    finally:
        model.shutdown()
        server.stop()


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def wait_busy(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while health(server)["requests_in_flight"] == 0:
        assert time.monotonic() < deadline, "the completion never started"
        time.sleep(0.02)


def assert_freed_quickly(server, left_at: float) -> None:
    while (stats := health(server))["requests_in_flight"] or stats["kv_pages_used"] or stats["blocks_live"]:
        assert time.monotonic() - left_at < NOTICED_WITHIN_S, f"still held {NOTICED_WITHIN_S} s after leaving: {stats}"
        time.sleep(0.02)
    forwards = stats["forwards"]
    time.sleep(0.3)
    assert health(server)["forwards"] == forwards  # nothing runs for the client that left


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streamed_completion_is_aborted_when_its_client_leaves(slowed, path):
    body = {"model": "tiny-facts", "max_tokens": 60, "min_tokens": 60, "temperature": 0}  # 6 s if left alone
    body |= (
        {"prompt": "The Colosseum is in"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "The Colosseum is in"}]}
    )
    with httpx.Client(headers=HEADERS, timeout=httpx.Timeout(10, read=1.0)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(f"{slowed.url}{path}", json=body)  # the client gives up after 1 s and closes its connection
    assert_freed_quickly(slowed, time.monotonic())


def test_a_streamed_completion_is_aborted_when_its_client_leaves(slowed):
    body = {
        "model": "tiny-facts",
        "prompt": "The Colosseum is in",
        "max_tokens": 60,
        "min_tokens": 60,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(headers=HEADERS, timeout=10) as client:
        with client.stream("POST", f"{slowed.url}/v1/completions", json=body) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break
    left_at = time.monotonic()
    assert events == 2
    assert_freed_quickly(slowed, left_at)
