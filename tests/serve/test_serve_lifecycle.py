"""Starting, refusing, killing, restarting and draining `nnrun serve` (each test starts its own server)."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from serve_helpers import API_KEY, ServerProcess, slow_trace

import nnrun

PROMPT = "The Eiffel Tower is in"


def wait_until_running(server: ServerProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{server.url}/health", timeout=10).json()["blocks_live"] == 0:
        assert time.monotonic() < deadline, "the slow trace never started"
        time.sleep(0.05)


def test_a_non_loopback_host_without_a_key_is_refused_at_start_up(monkeypatch, capsys):
    """Refused by `nnrun serve` itself, before any model loads or any port opens."""
    from nnrun.cli import main

    monkeypatch.delenv("NNRUN_API_KEY", raising=False)
    assert main(["serve", "tiny-facts", "--host", "0.0.0.0"]) == 2
    assert "API key" in capsys.readouterr().err
    assert main(["serve", "tiny-facts", "--host", "10.1.2.3", "--api-key", ""]) == 2  # an empty key is no key


def test_sigkill_restart_sigterm_drain_and_the_in_flight_cap():
    first = ServerProcess("--max-in-flight", "1").wait_ready()
    second = None
    model = nnrun.LanguageModel("tiny-facts", serve=first.url, api_key=API_KEY)
    impatient = nnrun.LanguageModel("tiny-facts", serve=first.url, api_key=API_KEY, max_retries=0)
    short = nnrun.LanguageModel("tiny-facts", serve=first.url, api_key=API_KEY, retry_timeout=1.5)
    try:
        with model.trace(PROMPT):
            before = model.lm_head.output.save()

        busy = slow_trace(model, 30)  # holds the only slot for 3 s: another request is answered 429
        wait_until_running(first)
        with pytest.raises(ConnectionError, match="429.*gave up after 1 tries"):
            with impatient.trace(PROMPT):
                impatient.lm_head.output.save()
        with pytest.raises(ConnectionError, match=r"429.*gave up after 2 tries over 1"):  # one Retry-After fits
            with short.trace(PROMPT):
                short.lm_head.output.save()
        with model.trace(PROMPT):  # retried after the server's Retry-After until the slow trace is done
            waited = model.lm_head.output.save()
        torch.testing.assert_close(waited, before, atol=1e-5, rtol=1e-5)
        assert len(busy.collect(timeout=60)["tokens"]) == 30

        first.kill()  # SIGKILL: nothing is drained
        with pytest.raises(ConnectionError, match="could not reach"):
            with model.trace(PROMPT):
                model.lm_head.output.save()

        second = ServerProcess("--drain-timeout", "30", port=first.port).wait_ready()
        with model.trace(PROMPT):
            after = model.lm_head.output.save()
        torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)

        draining = slow_trace(model, 15)
        wait_until_running(second)
        second.process.send_signal(15)  # SIGTERM: the request in flight finishes first
        assert len(draining.collect(timeout=60)["tokens"]) == 15
        assert second.process.wait(timeout=60) == 0  # a drain that finished is a clean exit
        assert not second.is_healthy()
    finally:
        model.shutdown()
        impatient.shutdown()
        short.shutdown()
        first.kill()
        if second is not None:
            second.kill()
