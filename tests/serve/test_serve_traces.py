"""nnsight traces on a real `nnrun serve`: client processes get what the same traces give in-process.

The reference for every served result is the same workload (tests/serve/workloads.py) run on an
in-process `nnrun.LanguageModel("tiny-facts")`, fp32, to 1e-5.
"""

from __future__ import annotations

import time
import warnings

import httpx
import pytest
import torch
from serve_helpers import API_KEY
from workloads import HOSTILE, run_local

import nnrun

# Client processes, each running its own mix; together they cover every workload.
INNOCENT = [
    ["logits", "layers", "intervention", "invokes", "shared_list", "non_blocking"],
    ["patching", "attention", "burst", "generation", "steered_generation"],
]
EXPECTED_ERRORS = {
    "garbage": "PayloadError",
    "wrong_path": "AttributeError",
    "raises": "KeyError",
    "endless_loop": "TimeoutError",
}


@pytest.fixture(scope="module")
def reference(local_model):
    """The workloads' in-process results, computed on first use (while client processes start)."""
    computed: dict = {}

    def get() -> dict:
        if not computed:
            computed.update(run_local(local_model, [name for group in INNOCENT for name in group]))
        return computed

    return get


def assert_same(got: dict, expected: dict, where: str) -> None:
    assert "error" not in got, f"{where} failed on the server: {got.get('error')}"
    assert got.keys() == expected.keys(), where
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=f"{where}: {name}")


def test_concurrent_clients_match_in_process_while_a_hostile_one_fails_alone(server, clients, tmp_path, reference):
    hostile = clients(server.url, list(HOSTILE), tmp_path / "hostile.pt")
    innocent = [clients(server.url, group, tmp_path / f"client{i}.pt") for i, group in enumerate(INNOCENT)]
    expected = reference()
    for client, group in zip(innocent, INNOCENT):
        results = client.result()
        for name in group:
            assert_same(results[name], expected[name], name)
    hostile_results = hostile.result()
    for name, error_type in EXPECTED_ERRORS.items():
        assert hostile_results[name].get("error", (None,))[0] == error_type, (name, hostile_results[name])
    assert hostile_results["writes_nan"]["out"].isnan().all()  # its own logits only: the others stayed exact
    assert server.is_healthy()


def test_nnsight_local_serve_backend_works_unchanged(server, reference):
    """nnsight 0.8.1's own serve client, on a meta nnsight model, against nnrun serve."""
    from transformers import AutoTokenizer
    from workloads import PROMPT

    from nnsight import LanguageModel as NNsightLanguageModel
    from nnsight.modeling.vllm.serve.backend import LocalServeBackend

    path = str(nnrun.bundled_model_path("tiny-facts"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NNsightLanguageModel(path, tokenizer=AutoTokenizer.from_pretrained(path), dispatch=False)
    with model.trace(PROMPT, backend=LocalServeBackend(model, server.url, api_key=API_KEY)):
        out = model.lm_head.output.save()
    torch.testing.assert_close(out, reference()["logits"]["logits"], atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="IndexError"):  # nnsight's deferred error names the real type
        with model.trace(PROMPT, backend=LocalServeBackend(model, server.url, api_key=API_KEY)):
            model.model.layers[0].output[5000].save()


def test_errors_come_back_with_their_type_and_the_block_line(remote):
    with pytest.raises(KeyError, match="raised inside the block") as caught:
        with remote.trace("The Colosseum is in"):
            hidden = remote.model.layers[1].output
            if hidden.shape[1] > 0:
                raise KeyError("raised inside the block")
    notes = "".join(getattr(caught.value, "__notes__", []))
    assert __file__ in notes and "raise KeyError(" in notes  # the block's own file and line


def test_per_request_token_limit(remote):
    with pytest.raises(ValueError, match="over this server's limit of 64"):
        with remote.generate("The Colosseum is in", max_new_tokens=65):
            remote.lm_head.output.save()


def test_plain_generate_and_non_blocking_collect(remote, reference):
    local_ids = reference()["generation"]["ids"]
    ids = remote.generate("The Eiffel Tower is in", max_new_tokens=4)
    assert torch.equal(ids, local_ids)
    with remote.trace("The Eiffel Tower is in", blocking=False) as tracer:
        late = remote.lm_head.output.save()
    assert "late" not in locals()  # nothing pushed until collect()
    saves = tracer.collect(timeout=60)
    assert torch.equal(saves["late"], late)


def test_auth_refuses_missing_and_wrong_keys(server):
    blob = b"not even a trace"
    assert httpx.post(f"{server.url}/v1/nnsight/generate", content=blob, timeout=10).status_code == 401
    wrong = {"ndif-api-key": API_KEY + "x"}
    assert httpx.post(f"{server.url}/v1/nnsight/generate", content=blob, headers=wrong, timeout=10).status_code == 401
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{server.url}/v1/nnsight/generate", content=blob, headers=bearer, timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # health needs no key
    with pytest.raises(ConnectionError, match="401"):
        model = nnrun.LanguageModel("tiny-facts", serve=server.url, api_key="wrong")
        with model.trace("The Eiffel Tower is in"):
            model.lm_head.output.save()


def test_request_body_limit(server):
    too_big = b"x" * (2 * 2**20)  # the shared server allows 1 MB
    response = httpx.post(
        f"{server.url}/v1/nnsight/generate", content=too_big, headers={"ndif-api-key": API_KEY}, timeout=30
    )
    assert response.status_code == 413
    assert "over this server's limit of 1048576 bytes" in response.json()["detail"]
    wrong_method = httpx.get(f"{server.url}/v1/nnsight/generate", headers={"ndif-api-key": API_KEY}, timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"


def test_a_client_that_disconnects_frees_its_requests(server, clients, tmp_path):
    client = clients(server.url, ["slow_generation"], tmp_path / "gone.pt")  # 6 s if left alone
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/health", timeout=10).json()["blocks_live"] == 0:  # wait until it runs
        assert time.monotonic() < deadline and client.process.poll() is None
        time.sleep(0.1)
    client.kill()
    deadline = time.monotonic() + 1  # the generation had over 5 s to go: the disconnect ended it, within a second
    while (stats := httpx.get(f"{server.url}/health", timeout=10).json())["requests_in_flight"] > 0:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["blocks_live"] == 0 and stats["kv_pages_used"] == 0


def test_health_counts_forwards_and_the_requests_that_shared_them(server):
    model = nnrun.LanguageModel("tiny-facts", serve=server.url, api_key=API_KEY)
    prompts = ["The Eiffel Tower is in", "The Colosseum is in"]
    num_tokens = sum(len(model.tokenizer(prompt)["input_ids"]) for prompt in prompts)
    counted = ("forwards", "batched_requests", "forwarded_tokens", "finished_requests")
    before = httpx.get(f"{server.url}/health", timeout=10).json()
    with model.trace() as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                model.lm_head.output.save()
    after = httpx.get(f"{server.url}/health", timeout=10).json()
    # A trace's invokes are requests admitted together: one forward of both prompts.
    assert {name: after[name] - before[name] for name in counted} == {
        "forwards": 1,
        "batched_requests": 2,
        "forwarded_tokens": num_tokens,
        "finished_requests": 2,
    }
