"""The real `openai` client against a real `nnrun serve` on loopback: it shows why a request was refused, and
reads lists of prompts and `n` samples.

The `openai` client puts a refusal's `error.message` in `str(e)` and its `error` object in `e.body`
(`e.param`, `e.code`); the oracles for choices are single-prompt requests and local greedy generation.
"""

from __future__ import annotations

import openai
import pytest
from serve_helpers import API_KEY

import nnrun

pytestmark = pytest.mark.slow

PROMPTS = ["The Colosseum is in", "The Eiffel Tower is in"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def refusal(call, error_type: type) -> openai.APIStatusError:
    with pytest.raises(error_type) as raised:
        call()
    return raised.value


def test_the_openai_client_shows_why_a_request_was_refused(client, server):
    def complete(**fields):
        return lambda: client.completions.create(**{"model": "tiny-facts", "prompt": PROMPTS[0], **fields})

    error = refusal(complete(max_tokens=0), openai.BadRequestError)
    assert "max_tokens: Input should be greater than or equal to 1" in str(error)
    assert error.param == "max_tokens" and error.body["param"] == "max_tokens"
    assert error.type == "invalid_request_error"

    error = refusal(complete(max_tokens=65), openai.BadRequestError)  # the server's --max-new-tokens is 64
    assert "max_tokens=65 is over this server's limit of 64" in str(error) and error.param == "max_tokens"

    error = refusal(complete(extra_body={"guided_json": {}}), openai.BadRequestError)
    assert "guided_json: Extra inputs are not permitted" in error.message and error.param == "guided_json"

    error = refusal(complete(n=2, best_of=3), openai.BadRequestError)
    assert "only best_of=n (2) is served" in str(error) and error.param == "best_of"

    error = refusal(
        lambda: client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}]),
        openai.NotFoundError,
    )
    assert "the model 'gpt-4o' does not exist; this server serves 'tiny-facts'" in str(error)
    assert error.param == "model" and error.code == "model_not_found"

    wrong_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0, timeout=60)
    error = refusal(lambda: wrong_key.models.list(), openai.AuthenticationError)
    assert "missing or invalid API key" in str(error) and error.code == "invalid_api_key"

    too_big = "x" * (2**20 + 2**16)  # the server's --max-body-mb is 1: just over, so the upload fits the socket buffers
    error = refusal(complete(prompt=too_big), openai.APIStatusError)
    assert error.status_code == 413 and "over this server's limit of 1048576 bytes" in str(error)


def test_the_openai_client_reads_a_list_of_prompts_and_n_samples(client, local_model):
    expected = [
        local_model.engine.generate(prompt, nnrun.SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text
        for prompt in PROMPTS
    ]
    answer = client.completions.create(model="tiny-facts", prompt=PROMPTS, n=2, max_tokens=6, temperature=0)
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in answer.choices] == [text for text in expected for _ in range(2)]
    single = client.completions.create(model="tiny-facts", prompt=PROMPTS[1], max_tokens=6, temperature=0)
    assert single.choices[0].text == expected[1]

    texts = ["", "", "", ""]
    for chunk in client.completions.create(
        model="tiny-facts", prompt=PROMPTS, n=2, max_tokens=6, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [choice.text for choice in answer.choices]

    seeded = client.chat.completions.create(
        model="tiny-facts", messages=[{"role": "user", "content": PROMPTS[0]}], n=3, seed=7, max_tokens=6
    )
    again = client.chat.completions.create(
        model="tiny-facts", messages=[{"role": "user", "content": PROMPTS[0]}], n=3, seed=7, max_tokens=6
    )
    assert [c.index for c in seeded.choices] == [0, 1, 2]
    assert [c.message.content for c in seeded.choices] == [c.message.content for c in again.choices]
