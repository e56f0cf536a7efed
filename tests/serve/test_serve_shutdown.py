"""SIGTERM with requests that outlast the drain: a stream ends with an error event, a trace gets a clear error,
and the server exits 0 within its drain timeout plus a few seconds.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from serve_helpers import API_KEY, ServerProcess, slow_trace

import nnrun
from nnrun.serve.wire import ServerShuttingDown

pytestmark = pytest.mark.slow

DRAIN_TIMEOUT_S = 2.0
PROMPT = "The Eiffel Tower is in"


def test_sigterm_cuts_what_outlasts_the_drain_with_clear_errors_and_exits_0():
    server = ServerProcess("--drain-timeout", str(DRAIN_TIMEOUT_S), "--max-new-tokens", "64").wait_ready()
    model = nnrun.LanguageModel("tiny-facts", serve=server.url, api_key=API_KEY)
    events: list[str] = []
    try:
        trace = slow_trace(model, 60)  # 6 s: past the drain
        body = {
            "model": "tiny-facts",
            "prompt": PROMPT,
            "max_tokens": 64,
            "min_tokens": 64,
            "temperature": 0,
            "stream": True,
        }
        with model.register(name="slow") as (tracer, edit):  # 0.1 s a step for the completion too
            for step in tracer.all():
                time.sleep(0.1)
                model.model.layers[0].output[:, -1] += 0
        first_event = threading.Event()

        def read_stream() -> None:
            with httpx.stream(
                "POST",
                f"{server.url}/v1/completions",
                json=body,
                timeout=30,
                headers={"Authorization": f"Bearer {API_KEY}"},
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_event.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert first_event.wait(timeout=30), "the stream never started"
        started = time.monotonic()
        server.process.terminate()

        with pytest.raises(ServerShuttingDown, match="drain timeout of 2 s"):
            trace.collect(timeout=30)
        reader.join(timeout=30)
        assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"], events[-3:]
        assert len(events) < 64  # cut: the stream did not run its 64 tokens
        assert server.process.wait(timeout=DRAIN_TIMEOUT_S + 10) == 0, server.output()
        assert time.monotonic() - started < DRAIN_TIMEOUT_S + 5
    finally:
        model.shutdown()
        server.kill()
