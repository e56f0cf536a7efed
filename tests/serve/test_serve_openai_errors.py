"""Every refusal on the OpenAI routes is in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
whoever refuses it (the key, the limits, validation, the routes, a failure); nnsight's routes keep `{"detail"}`.

On the app in-process; `test_serve_openai_client.py` reads the same refusals with the real `openai` client.
"""

from __future__ import annotations

import json

import pytest
from serve_helpers import API_KEY

from nnrun.serve.openai_errors import OpenAIError, stream_error_event

BASE = {"model": "tiny-facts", "prompt": "The Colosseum is in", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny-facts", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

# (path, body, status, param, code, what the message says)
REFUSALS = [
    ("/v1/completions", {**BASE, "max_tokens": 0}, 400, "max_tokens", None, "greater than or equal to 1"),
    ("/v1/completions", {**BASE, "max_tokens": 9}, 400, "max_tokens", None, "over this server's limit of 8"),
    ("/v1/completions", {**BASE, "no_such_field": 1}, 400, "no_such_field", None, "Extra inputs"),
    ("/v1/completions", {**BASE, "suffix": "!"}, 400, "suffix", None, "suffix='!' is refused"),
    ("/v1/completions", {**BASE, "prompt": []}, 400, "prompt", None, "at least 1 item"),
    ("/v1/completions", {**BASE, "prompt": ["fine", 7]}, 400, "prompt", None, "prompt"),
    ("/v1/completions", {**BASE, "prompt": [[1, 2], [10**9]]}, 400, "prompt", None, "prompt[1]"),
    ("/v1/completions", {**BASE, "seed": 2**64 - 1, "n": 2}, 400, "seed", None, "past the largest seed"),
    ("/v1/completions", {**BASE, "model": "gpt-4"}, 404, "model", "model_not_found", "'gpt-4' does not exist"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model", "model_not_found", "does not exist"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
        None,
        "role",
    ),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", None, "tools="),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 50}, 400, "max_completion_tokens", None, "limit of 8"),
]


def assert_openai_error(response, status: int, param: str | None, code: str | None, says: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert says in error["message"], error
    assert error["param"] == param and error["code"] == code, error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error") or status in (401, 429)
    return error


@pytest.mark.parametrize("path, body, status, param, code, says", REFUSALS, ids=[str(r[3]) for r in REFUSALS])
def test_route_refusals_name_the_field(asgi, path, body, status, param, code, says):
    assert_openai_error(asgi.post(path, json=body), status, param, code, says)


def test_refusals_before_any_route_are_in_openais_shape_too(asgi):
    keyless = asgi.post("/v1/completions", json=BASE, headers={"Authorization": "Bearer wrong"})
    error = assert_openai_error(keyless, 401, None, "invalid_api_key", "missing or invalid API key")
    assert error["type"] == "authentication_error"
    too_big = asgi.post("/v1/completions", json={**BASE, "prompt": "x" * 2**17})
    assert_openai_error(too_big, 413, None, "request_too_large", "over this server's limit of 65536 bytes")
    not_json = asgi.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_openai_error(not_json, 400, None, None, "not valid JSON")
    unknown = asgi.get("/v1/embeddings")
    assert_openai_error(unknown, 404, None, None, "GET /v1/embeddings is not served here")

    guard = asgi.guard
    guard.num_in_flight = guard.max_in_flight
    try:
        busy = asgi.post("/v1/completions", json=BASE)
    finally:
        guard.num_in_flight = 0
    error = assert_openai_error(busy, 429, None, "rate_limit_exceeded", "serving its limit of 64 requests")
    assert error["type"] == "rate_limit_error" and busy.headers["retry-after"] == "1"

    asgi.state.is_stopping = True
    try:
        stopping = asgi.post("/v1/chat/completions", json=CHAT)
    finally:
        asgi.state.is_stopping = False
    assert_openai_error(stopping, 503, None, "service_unavailable", "the engine is not serving")


def test_an_unexpected_failure_is_a_500_with_its_reason(asgi, served, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("the disk is on fire")

    monkeypatch.setattr(served, "submit_completions", fail)
    response = asgi.post("/v1/completions", json=BASE)
    error = assert_openai_error(response, 500, None, None, "RuntimeError: the disk is on fire")
    assert error["type"] == "server_error"


def test_a_stream_that_cannot_finish_ends_with_an_openai_error_event():
    event = stream_error_event(OpenAIError(504, "the request ran past this server's time limit"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    error = json.loads(event[6:])["error"]
    assert error == {
        "message": "the request ran past this server's time limit",
        "type": "server_error",
        "param": None,
        "code": "timeout",
    }
    assert json.loads(stream_error_event(ValueError("bad"))[6:])["error"]["message"] == "ValueError: bad"


def test_nnsight_routes_keep_their_detail(asgi):
    keyless = asgi.post("/v1/nnsight/generate", content=b"x", headers={"Authorization": "Bearer wrong"})
    assert keyless.status_code == 401 and keyless.json() == {"detail": "missing or invalid API key"}
    garbage = asgi.post("/v1/nnsight/register/r1", content=b"garbage", headers={"ndif-api-key": API_KEY})
    assert garbage.status_code == 400 and "not a serialized nnsight edit" in garbage.json()["detail"]
    assert asgi.get("/health").json()["status"] == "ok"
