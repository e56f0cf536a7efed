"""Fixtures for the serve tests: one real `nnrun serve tiny-facts` on 127.0.0.1 shared by the session,
an in-process reference model, and client processes.

Tests that kill, restart or refuse servers start their own. Every process started here is killed
when its test (or the session) ends, pass or fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_helpers import API_KEY, Client, ServerProcess


@pytest.fixture(scope="session")
def server():
    process = ServerProcess("--request-timeout", "60", "--block-timeout", "2", "--max-new-tokens", "64",
                            "--max-in-flight", "48", "--max-body-mb", "1")
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def remote(server):
    """A serve client of the shared server; edits its module registered are cleared when it ends."""
    import nnrun

    model = nnrun.LanguageModel("tiny-facts", serve=server.url, api_key=API_KEY)
    yield model
    model.clear_edits()
    model.shutdown()


@pytest.fixture(scope="session")
def local_model():
    """An in-process engine over the same model: the reference every served result is compared with."""
    import warnings

    import nnrun

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nnrun.LanguageModel("tiny-facts")
    yield model
    model.shutdown()


@pytest.fixture
def clients():
    """Start client processes with `clients(url, workloads, out)`; all are killed when the test ends."""
    started: list[Client] = []

    def start(url: str, workloads: list[str], out: Path, api_key: str | None = API_KEY) -> Client:
        client = Client(url, workloads, out, api_key)
        started.append(client)
        return client

    try:
        yield start
    finally:
        for client in started:
            client.kill()
