"""Fixtures for the serve tests: one real `nnrun serve tiny-facts` on 127.0.0.1 shared by the session,
an in-process reference model, and client processes.

Tests that kill, restart or refuse servers start their own. Every process started here is killed
when its test (or the session) ends, pass or fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_helpers import API_KEY, Client, ServerProcess


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """This process computes the references with one torch thread, as the servers here run (`child_env`).

    The tests compare a trace batched with other clients' on the server against the same trace
    run alone here. With one thread a matmul sums every row the same way whatever the row count,
    so the two agree to the bit. With two, some CPUs' sgemm splits the reduction differently by
    row count (an AVX2 EPYC: 1.2e-5 on a logit of a 20-trace burst), which is the kernel's
    rounding, not anything the server did to the request.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # before any engine thread here starts: a thread takes the count when it first runs an op
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def server():
    process = ServerProcess(
        "--request-timeout",
        "60",
        "--block-timeout",
        "2",
        "--max-new-tokens",
        "64",
        "--max-in-flight",
        "48",
        "--max-body-mb",
        "1",
    )
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


@pytest.fixture(scope="module")
def served():
    """The server's model, in this process: payloads are run on it by `run_trace`, without HTTP."""
    import warnings

    from nnrun.serve.engine_model import ServedLanguageModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ServedLanguageModel("tiny-facts", max_new_tokens=8)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def client():
    """A serve client whose server is never contacted: `payloads` answers its posts."""
    import warnings

    import nnrun

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nnrun.LanguageModel("tiny-facts", serve="http://127.0.0.1:9")  # never contacted
    yield model
    model.shutdown()


@pytest.fixture
def payloads(served, monkeypatch):
    """The client's posts, answered by `run_trace` on `served` in this process; the bodies are kept."""
    from nnrun.serve import trace_route, transport
    from nnrun.serve.engine_model import RequestLimits

    sent: list[bytes] = []

    def post(self, path, content, params=None):
        sent.append(content)
        return trace_route.run_trace(served, content, RequestLimits(60, 10), raw_tensors=True)

    monkeypatch.setattr(transport.Connection, "post", post)
    return sent


@pytest.fixture(scope="module")
def asgi(served):
    """The server's app over `served`, in this process, and a keyed client of it: no socket, no server process.

    Its limits are small enough to pass from a test: bodies of 64 KiB, 8 new tokens.
    """
    from starlette.testclient import TestClient

    from nnrun.serve.app import create_app
    from nnrun.serve.config import ServeConfig

    config = ServeConfig(model="tiny-facts", api_key=API_KEY, max_new_tokens=8, max_body_bytes=2**16)
    guard = create_app(config, served)
    client = TestClient(guard, raise_server_exceptions=False, headers={"Authorization": f"Bearer {API_KEY}"})
    client.guard = guard  # the limits, for tests that fill them
    client.state = guard.app.state  # the routes' `ServeState` (guard.app is the trace route)
    yield client
    client.state.executor.shutdown(wait=False)
