"""Bad input gets a ValueError naming what was wrong, and the engine keeps serving."""

from __future__ import annotations

import threading

import pytest

import nnrun
from model_zoo import VOCAB, make_model, random_prompts


@pytest.fixture(scope="module")
def llm():
    with nnrun.LLM(make_model("llama"), max_model_len=128) as engine:
        yield engine


@pytest.mark.parametrize(
    "make_call, match",
    [
        (lambda llm: llm.generate([""]), "empty"),
        (lambda llm: llm.generate([[]]), "no token ids"),
        (
            lambda llm: llm.generate([[1, 2], [3, VOCAB]]),
            r"prompts\[1\] token id 256 at position 1 is out of the vocabulary",
        ),
        (lambda llm: llm.generate([[1, -1]]), "out of the vocabulary"),
        (lambda llm: llm.generate([[1] * 128]), "max_model_len"),
        (lambda llm: llm.generate([[1, 2]], nnrun.SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate([[1, 2]], nnrun.SamplingParams(max_tokens=-3)), "max_tokens"),
        (lambda llm: llm.generate([[1, 2]], nnrun.SamplingParams(temperature=-0.5)), "temperature"),
        (lambda llm: llm.generate([[1, 2]], nnrun.SamplingParams(stop=7)), "stop"),
        (lambda llm: llm.generate([[1, 2]], nnrun.SamplingParams(stop_token_ids=["x"])), "stop_token_ids"),
        (lambda llm: llm.generate([[1, 2]], nnrun.SamplingParams(top_p=0)), "top_p"),
        (lambda llm: llm.generate([[1, 2], [3]], [nnrun.SamplingParams()]), "sampling_params has 1 entries for 2"),
        (lambda llm: llm.generate(["text"]), "no tokenizer"),
    ],
)
def test_each_bad_input_is_a_value_error_naming_the_field(llm, make_call, match):
    with pytest.raises(ValueError, match=match):
        make_call(llm)


def test_engine_keeps_serving_while_bad_requests_are_refused(llm):
    prompt = random_prompts([20], seed=4)[0]
    params = nnrun.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].outputs[0].token_ids
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=llm.generate([prompt], params)))
    worker.start()
    for bad in ([""], [[VOCAB + 5]], [[1] * 500]):
        with pytest.raises(ValueError):
            llm.generate(bad)
    worker.join()
    assert result["out"][0].outputs[0].token_ids == expected
    llm.runner.allocator.check_no_leaks()


def test_a_prompt_larger_than_the_kv_pool_is_refused():
    with nnrun.LLM(make_model("llama"), page_size=4, max_total_tokens=32) as small:
        with pytest.raises(ValueError, match="KV pool 32 tokens"):
            small.generate([[1] * 40])
        assert len(small.generate([[1] * 10], nnrun.SamplingParams(max_tokens=2))[0].outputs[0].token_ids) <= 2
