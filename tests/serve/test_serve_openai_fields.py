"""Every OpenAI field is served with OpenAI's meaning or refused with a 400 that names it (OpenAI's `param`).

Served fields are checked against local generation (`nnrun.LLM.generate`, greedy) with the same
sampling settings; refused ones against the field name in the answer.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from serve_helpers import API_KEY

import nnrun

pytestmark = pytest.mark.slow

PROMPT = "The Colosseum is in"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BASE = {"model": "tiny-facts", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
CHAT = {"model": "tiny-facts", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0}

REFUSED_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"echo": 1}, "echo"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"best_of": 2}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"suffix": "!"}, "suffix"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"logit_bias": {"50": 100}}, "logit_bias"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"prompt": ["a text", [1, 2]]}, "prompt"),
    ({"model": 7}, "model"),
]
REFUSED_CHAT = [
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "wizard", "content": PROMPT}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, "messages.content.type"),
    ({"messages": []}, "messages"),
]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=HEADERS, timeout=60)


@pytest.mark.parametrize("change, field", REFUSED_COMPLETIONS, ids=[f for _, f in REFUSED_COMPLETIONS])
def test_completions_refuse_what_they_do_not_serve_naming_the_field(server, change, field):
    response = post(server, "/v1/completions", {**BASE, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] and error["param"] == field, response.text


@pytest.mark.parametrize("change, field", REFUSED_CHAT, ids=[f for _, f in REFUSED_CHAT])
def test_chat_refuses_what_it_does_not_serve_naming_the_field(server, change, field):
    response = post(server, "/v1/chat/completions", {**CHAT, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] and error["param"] == field, response.text


def test_served_fields_mean_what_they_mean_locally(server, local_model):
    def local(**params) -> nnrun.RequestOutput:
        return local_model.engine.generate(PROMPT, nnrun.SamplingParams(temperature=0, **params))[0]

    # The default of max_tokens is OpenAI's 16; token ids as the prompt; what does not change the answer.
    default = post(server, "/v1/completions", {k: v for k, v in BASE.items() if k != "max_tokens"}).json()
    assert default["choices"][0]["text"] == local(max_tokens=16).outputs[0].text
    ids = local_model.tokenizer(PROMPT)["input_ids"]
    by_ids = post(server, "/v1/completions", {**BASE, "prompt": ids, "best_of": 1, "user": "someone"}).json()
    assert by_ids["choices"][0]["text"] == local(max_tokens=6).outputs[0].text

    # vLLM's min_tokens and ignore_eos: a generation that would stop early runs its full length.
    forced = post(server, "/v1/completions", {**BASE, "max_tokens": 12, "min_tokens": 12}).json()
    expected = local(max_tokens=12, min_tokens=12)
    assert forced["choices"][0]["text"] == expected.outputs[0].text
    assert forced["usage"]["completion_tokens"] == len(expected.outputs[0].token_ids) == 12

    # stream_options.include_usage: a last chunk with the usage the plain answer gives.
    plain = post(server, "/v1/completions", BASE).json()
    streamed = post(server, "/v1/completions", {**BASE, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [
        json.loads(line[6:])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks[:-1]) == plain["choices"][0]["text"]

    # Chat content as text parts reads as the same text.
    parts = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}
    assert (
        post(server, "/v1/chat/completions", parts).json()["choices"][0]["message"]["content"]
        == post(server, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["content"]
    )


def test_logprobs_are_the_models_log_softmax_in_openais_shapes(server, local_model):
    num_tokens = 6
    local = local_model.engine.generate(PROMPT, nnrun.SamplingParams(max_tokens=num_tokens, temperature=0, logprobs=3))[
        0
    ].outputs[0]
    with local_model.trace(PROMPT):
        logits = local_model.lm_head.output[0, -1].save()
    first_logprobs = torch.log_softmax(logits.float(), dim=-1)  # the first generated token's, from the model itself
    decode = local_model.tokenizer.decode

    answer = post(server, "/v1/completions", {**BASE, "logprobs": 3}).json()["choices"][0]["logprobs"]
    assert answer["tokens"] == [decode([token_id]) for token_id in local.token_ids]
    # The server's engine and this one run the same kernels on the same prompt, one torch thread each.
    torch.testing.assert_close(
        torch.tensor(answer["token_logprobs"]),
        torch.tensor([entry[t] for t, entry in zip(local.token_ids, local.logprobs)]),
        atol=1e-5,
        rtol=1e-5,
    )
    assert abs(answer["token_logprobs"][0] - first_logprobs[local.token_ids[0]].item()) < 1e-4
    top = torch.topk(first_logprobs, 3)
    assert answer["top_logprobs"][0] == pytest.approx(
        {decode([i]): v for i, v in zip(top.indices.tolist(), top.values.tolist())}, abs=1e-4
    )
    assert answer["text_offset"][0] == 0 and answer["text_offset"][1] == len(answer["tokens"][0])

    only_sampled = post(server, "/v1/completions", {**BASE, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert [list(entry) for entry in only_sampled["top_logprobs"]] == [[token] for token in answer["tokens"]]

    streamed = post(server, "/v1/completions", {**BASE, "logprobs": 3, "stream": True})
    chunks = [
        json.loads(line[6:])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    pieces = [chunk["choices"][0]["logprobs"] for chunk in chunks]
    assert [token for piece in pieces for token in piece["tokens"]] == answer["tokens"]
    assert [lp for piece in pieces for lp in piece["token_logprobs"]] == answer["token_logprobs"]

    chat = post(server, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    for token in content:  # greedy: the sampled token is the most likely one
        assert len(token["top_logprobs"]) == 2 and token["top_logprobs"][0]["token"] == token["token"]
        assert token["top_logprobs"][0]["logprob"] == token["logprob"] >= token["top_logprobs"][1]["logprob"]
        assert bytes(token["bytes"]).decode() == token["token"]
    assert post(server, "/v1/chat/completions", CHAT).json()["choices"][0]["logprobs"] is None


def test_echo_shows_the_prompt_and_its_logprobs(server, local_model):
    expected = local_model.engine.generate(PROMPT, nnrun.SamplingParams(max_tokens=6, temperature=0))[0]
    plain = post(server, "/v1/completions", {**BASE, "echo": True}).json()["choices"][0]
    assert plain["text"] == PROMPT + expected.outputs[0].text and plain["logprobs"] is None

    prompt_ids = expected.prompt_token_ids
    with local_model.trace(PROMPT):
        logits = local_model.lm_head.output[0].save()
    # Token i of the prompt as the model predicted it from the tokens before it.
    predicted = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(prompt_ids) - 1), prompt_ids[1:]]
    answer = post(server, "/v1/completions", {**BASE, "echo": True, "logprobs": 1}).json()["choices"][0]
    logprobs = answer["logprobs"]
    assert answer["text"] == plain["text"]
    assert logprobs["tokens"][: len(prompt_ids)] == [local_model.tokenizer.decode([t]) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    torch.testing.assert_close(
        torch.tensor(logprobs["token_logprobs"][1 : len(prompt_ids)]), predicted, atol=1e-4, rtol=1e-4
    )
    assert len(logprobs["tokens"]) == len(prompt_ids) + len(expected.outputs[0].token_ids)

    streamed = post(server, "/v1/completions", {**BASE, "echo": True, "stream": True})
    chunks = [
        json.loads(line[6:])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == plain["text"]
