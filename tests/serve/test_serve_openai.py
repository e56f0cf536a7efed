"""OpenAI clients on `nnrun serve`, with and without a registered steering edit.

The references are local: `nnrun.LLM.generate` (greedy) for plain completions, and the same
steering written as a local `nnrun.LanguageModel` generation for steered ones.
"""

from __future__ import annotations

import openai
import pytest
import torch
from serve_helpers import API_KEY

import nnrun

PROMPT = "The Colosseum is in"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def local(local_model):
    return local_model


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def complete(client, stream: bool = False, chat: bool = False) -> str:
    if chat:
        messages = [{"role": "user", "content": PROMPT}]
        if not stream:
            answer = client.chat.completions.create(
                model="tiny-facts", messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            return answer.choices[0].message.content
        chunks = client.chat.completions.create(
            model="tiny-facts", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    if not stream:
        return (
            client.completions.create(model="tiny-facts", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
            .choices[0]
            .text
        )
    chunks = list(
        client.completions.create(model="tiny-facts", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    assert len(chunks) > 1 and chunks[-1].choices[0].finish_reason in ("stop", "length")
    return "".join(chunk.choices[0].text for chunk in chunks)


def steering_vector(local) -> torch.Tensor:
    paris = local.lm_head.weight[local.tokenizer(" Paris", add_special_tokens=False).input_ids[0]].detach()
    return paris / paris.norm() * 200  # the last layer's hidden states have norm ~120 here


def test_completions_and_chat_match_local_greedy_generation(client, local):
    expected = local.engine.generate(PROMPT, nnrun.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
    for stream in (False, True):
        for chat in (False, True):
            assert complete(client, stream, chat) == expected.outputs[0].text, (stream, chat)


def test_a_registered_steering_edit_applies_to_openai_clients_and_traces(client, local, remote):
    steer = steering_vector(local)
    with local.generate(PROMPT, max_new_tokens=MAX_TOKENS) as tracer:
        tokens = list().save()
        for step in tracer.all():
            local.model.layers[3].output[:, -1] += steer
            tokens.append(local.samples)
    steered_text = local.tokenizer.decode(torch.cat(tokens), skip_special_tokens=True)
    plain_text = complete(client)
    assert steered_text != plain_text

    with remote.register(name="paris") as (tracer, edit):
        last_hidden = list().save()
        for step in tracer.all():
            remote.model.layers[3].output[:, -1] += steer
            last_hidden.append(remote.model.layers[3].output[:, -1])
    try:
        assert complete(client) == steered_text
        assert complete(client, stream=True) == steered_text
        with remote.trace(PROMPT) as trace:
            top = remote.lm_head.output[0, -1].argmax().save()
        assert local.tokenizer.decode(top) == " Paris"  # the trace ran after the edit, on the same request
        (edit_saves,) = trace.edit_saves
        assert len(edit_saves["paris"]["last_hidden"]) == 1  # the edit's own saves, on the trace's output
        with pytest.raises(ValueError, match="no edit is installed under that name"):
            with remote.trace(PROMPT, edits=["no-such-edit"]):
                remote.lm_head.output.save()
    finally:
        edit.clear()
    assert complete(client) == plain_text
