"""Several choices in one OpenAI request: a list of prompts, `n` samples of each, streamed or not, on the app in-process.

The oracles are single-prompt requests to the same app and the engine's own requests
(`engine.generate`): a list's choice i is prompt i's answer; greedy samples are all the greedy
answer; seeded sample j of a request seeded s is the engine's request seeded s + j (vLLM's rule).
"""

from __future__ import annotations

import json

import nnrun
from nnrun.serve.openai_protocol import MAX_CHOICES
from nnrun.serve.openai_routes import _chat_prompt

PROMPTS = ["The Colosseum is in", "The Eiffel Tower is in", "The capital of Germany is"]
MAX_TOKENS = 8
BASE = {"model": "tiny-facts", "max_tokens": MAX_TOKENS}
SEED = 1234
HOT = 2.0  # a temperature at which this small model's samples differ from one another


def post(asgi, body: dict, path: str = "/v1/completions") -> dict:
    response = asgi.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream(asgi, body: dict, path: str = "/v1/completions") -> list[dict]:
    response = asgi.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def local(served, prompt, **params) -> nnrun.CompletionOutput:
    """The engine's own request, alone."""
    return served.engine.generate(prompt, nnrun.SamplingParams(max_tokens=MAX_TOKENS, **params))[0].outputs[0]


def tokens(served, completion) -> list[str]:
    return [served.tokenizer.decode([token_id]) for token_id in completion.token_ids]


def test_a_list_of_prompts_answers_each_as_its_own_request(asgi, served):
    listed = post(asgi, {**BASE, "prompt": PROMPTS, "temperature": 0, "logprobs": 0})
    assert [choice["index"] for choice in listed["choices"]] == [0, 1, 2]
    expected = [local(served, prompt, temperature=0) for prompt in PROMPTS]
    for prompt, choice, alone in zip(PROMPTS, listed["choices"], expected):
        single = post(asgi, {**BASE, "prompt": prompt, "temperature": 0, "logprobs": 0})["choices"][0]
        assert choice["text"] == single["text"] == alone.text
        assert choice["logprobs"]["tokens"] == single["logprobs"]["tokens"] == tokens(served, alone)
    num_prompt_tokens = sum(len(served.tokenizer(prompt).input_ids) for prompt in PROMPTS)
    num_generated = sum(len(alone.token_ids) for alone in expected)
    assert listed["usage"] == {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_generated,
        "total_tokens": num_prompt_tokens + num_generated,
    }

    # Token ids as the prompts, and echo: each choice shows its own prompt.
    ids = [served.tokenizer(prompt).input_ids for prompt in PROMPTS]
    by_ids = post(asgi, {**BASE, "prompt": ids, "temperature": 0})
    assert [choice["text"] for choice in by_ids["choices"]] == [alone.text for alone in expected]
    echoed = post(asgi, {**BASE, "prompt": PROMPTS, "temperature": 0, "echo": True})
    assert [choice["text"] for choice in echoed["choices"]] == [p + alone.text for p, alone in zip(PROMPTS, expected)]


def test_n_greedy_samples_are_the_greedy_answer(asgi, served):
    answer = post(asgi, {**BASE, "prompt": PROMPTS[0], "n": 3, "temperature": 0})
    greedy = local(served, PROMPTS[0], temperature=0)
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    assert [choice["text"] for choice in answer["choices"]] == [greedy.text] * 3
    assert answer["usage"]["prompt_tokens"] == len(served.tokenizer(PROMPTS[0]).input_ids)  # counted once
    assert answer["usage"]["completion_tokens"] == 3 * len(greedy.token_ids)


def test_seeded_samples_are_the_engines_requests_seeded_s_plus_j(asgi, served):
    n = 4
    answer = post(asgi, {**BASE, "prompt": PROMPTS[0], "n": n, "temperature": HOT, "seed": SEED, "logprobs": 0})
    expected = [local(served, PROMPTS[0], temperature=HOT, seed=SEED + j) for j in range(n)]
    assert [choice["logprobs"]["tokens"] for choice in answer["choices"]] == [tokens(served, e) for e in expected]
    assert [choice["text"] for choice in answer["choices"]] == [e.text for e in expected]
    assert len({e.text for e in expected}) > 1  # the samples differ: not one seed for all
    again = post(asgi, {**BASE, "prompt": PROMPTS[0], "n": n, "temperature": HOT, "seed": SEED})
    assert [choice["text"] for choice in again["choices"]] == [e.text for e in expected]

    # Unseeded, each sample is drawn apart too. " Rome." comes about 4 times in 5: 64 of them all alike would
    # happen about once in 10^6 runs.
    unseeded = post(asgi, {**BASE, "prompt": PROMPTS[0], "n": 64, "temperature": HOT})
    assert len({choice["text"] for choice in unseeded["choices"]}) > 1

    # A list and n: choice i * n + j is prompt i's sample j.
    listed = post(asgi, {**BASE, "prompt": PROMPTS[:2], "n": 2, "temperature": HOT, "seed": SEED})
    assert [choice["index"] for choice in listed["choices"]] == [0, 1, 2, 3]
    assert [choice["text"] for choice in listed["choices"]] == [
        local(served, prompt, temperature=HOT, seed=SEED + j).text for prompt in PROMPTS[:2] for j in range(2)
    ]


def test_streamed_choices_are_the_unstreamed_ones_chunk_by_chunk(asgi):
    body = {**BASE, "prompt": PROMPTS[:2], "n": 2, "temperature": HOT, "seed": SEED}
    plain = post(asgi, body)
    chunks = stream(asgi, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    texts, reasons = {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]  # one choice per chunk, as OpenAI and vLLM stream them
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            assert choice["index"] not in reasons
            reasons[choice["index"]] = choice["finish_reason"]
    assert [texts[i] for i in range(4)] == [choice["text"] for choice in plain["choices"]]
    assert [reasons[i] for i in range(4)] == [choice["finish_reason"] for choice in plain["choices"]]


def test_chat_takes_n(asgi, served):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    body = {**BASE, "messages": messages, "n": 3, "temperature": HOT, "seed": SEED}
    answer = post(asgi, body, "/v1/chat/completions")
    prompt = _chat_prompt(served.tokenizer, messages)
    expected = [local(served, prompt, temperature=HOT, seed=SEED + j).text for j in range(3)]
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    assert [choice["message"]["content"] for choice in answer["choices"]] == expected

    chunks = stream(asgi, body, "/v1/chat/completions")
    texts = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert [texts[i] for i in range(3)] == expected
    assert sum(chunk["choices"][0]["delta"].get("role") == "assistant" for chunk in chunks) == 3  # one per choice


def test_too_many_choices_are_refused_naming_the_limit(asgi):
    response = asgi.post("/v1/completions", json={**BASE, "prompt": ["a", "b", "c"], "n": MAX_CHOICES // 2})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "n"
    assert f"limit of {MAX_CHOICES}" in error["message"] and "split the prompts" in error["message"]
    best_of = asgi.post("/v1/completions", json={**BASE, "prompt": "a", "n": 2, "best_of": 3}).json()["error"]
    assert best_of["param"] == "best_of" and "only best_of=n" in best_of["message"]
    assert post(asgi, {**BASE, "prompt": "a", "n": 2, "best_of": 2, "temperature": 0})["choices"][1]["index"] == 1
