"""Bad inputs raise a ValueError naming the field and the value at the user's call; the engine keeps serving.

Numpy and tensor inputs that mean the same prompt as a Python list give the same tokens (the oracle
is the list), and after every refused call a good request still gets its solo tokens.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import nnrun
from model_zoo import VOCAB, make_model, random_prompts
from tolerance import assert_close_packed

NAN, INF = float("nan"), float("inf")
GREEDY = nnrun.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
FACT = "The Louvre Museum is in"


@pytest.fixture(scope="module")
def llm():
    with nnrun.LLM(make_model("llama"), max_model_len=128) as engine:
        yield engine


@pytest.fixture(scope="module")
def lm():
    model = nnrun.LanguageModel("tiny-facts")
    yield model
    model.shutdown()


def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


# ---- SamplingParams --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=NAN), "temperature must be a finite number in \\[0, inf\\), got nan"),
        (dict(temperature=INF), "temperature must be a finite number in \\[0, inf\\), got inf"),
        (dict(temperature="0.5"), "temperature must be a number, got str '0.5'"),
        (dict(temperature=True), "temperature must be a number, got bool True"),
        (dict(temperature=1e-300), "temperature must be 0 \\(greedy\\) or at least 1e-05, got 1e-300"),
        (dict(repetition_penalty=NAN), "repetition_penalty must be a finite number in \\(0, inf\\), got nan"),
        (dict(repetition_penalty=INF), "repetition_penalty must be a finite number in \\(0, inf\\), got inf"),
        (dict(top_p=NAN), "top_p must be a finite number in \\(0, 1\\], got nan"),
        (dict(top_p="1"), "top_p must be a number, got str '1'"),
        (dict(min_p=NAN), "min_p must be a finite number in \\[0, 1\\], got nan"),
        (dict(frequency_penalty=NAN), "frequency_penalty must be a finite number in \\[-2, 2\\], got nan"),
        (dict(presence_penalty=-INF), "presence_penalty must be a finite number in \\[-2, 2\\], got -inf"),
        (dict(seed=2**70), f"seed must be in \\[{-(2**63)}, {2**64 - 1}\\], got {2**70}"),
        (dict(seed=-(2**63) - 1), f"seed must be in \\[{-(2**63)}, {2**64 - 1}\\], got {-(2**63) - 1}"),
        (dict(seed=1.5), "seed must be an int or None, got float 1.5"),
        (dict(seed="7"), "seed must be an int or None, got str '7'"),
        (dict(max_tokens=True), "max_tokens must be an int or None, got bool True"),
        (dict(max_tokens=np.float64(3.0)), "max_tokens must be an int or None, got float64 np.float64\\(3.0\\)"),
        (dict(min_tokens=False), "min_tokens must be an int, got bool False"),
        (dict(top_k=-2), "top_k must be >= -1, got -2"),
        (dict(top_k=2.0), "top_k must be an int, got float 2.0"),
        (dict(logprobs=True), "logprobs must be an int or None, got bool True"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be >= 0, got -1"),
        (dict(stop_token_ids=[1, -3]), "stop_token_ids must be a list of non-negative ints, got \\[1, -3\\]"),
        (dict(stop_token_ids=[True]), "stop_token_ids must be a list of non-negative ints, got \\[True\\]"),
        (dict(ignore_eos="false"), "ignore_eos must be True or False, got str 'false'"),
        (dict(skip_special_tokens=1), "skip_special_tokens must be True or False, got int 1"),
    ],
)
def test_bad_sampling_params_name_the_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=f"SamplingParams.{match}"):
        nnrun.SamplingParams(**kwargs)


def test_numpy_numbers_are_sampling_params_like_python_ones(llm):
    as_numpy = nnrun.SamplingParams(
        max_tokens=np.int64(5),
        temperature=np.float32(0.5),
        top_p=np.float64(0.9),
        top_k=np.int32(40),
        repetition_penalty=np.float16(1.5),
        seed=np.int64(3),
        stop_token_ids=[np.int64(7)],
        logprobs=np.int8(2),
        ignore_eos=True,
    )
    as_python = nnrun.SamplingParams(
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        repetition_penalty=1.5,
        seed=3,
        stop_token_ids=[7],
        logprobs=2,
        ignore_eos=True,
    )
    assert as_numpy == as_python
    for name in ("max_tokens", "temperature", "top_k", "seed", "logprobs", "stop_token_ids"):
        assert repr(getattr(as_numpy, name)) == repr(getattr(as_python, name)), name  # Python numbers, not numpy
    prompt = random_prompts([9], seed=2)[0]
    assert _tokens(llm, [prompt], as_numpy) == _tokens(llm, [prompt], as_python)


def test_every_seed_torch_accepts_is_accepted(llm):
    prompt = random_prompts([5], seed=3)[0]
    for seed in (-(2**63), 2**64 - 1):
        params = nnrun.SamplingParams(max_tokens=3, seed=seed, ignore_eos=True)
        assert _tokens(llm, [prompt], params) == _tokens(llm, [prompt], params)


# ---- prompts to LLM.generate ----------------------------------------------------------------
@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[1, 2.0]], r"prompts\[0\] token id 2.0 at position 1 is not an integer \(got float\)"),
        ([[1, True]], r"prompts\[0\] token id True at position 1 is not an integer \(got bool\)"),
        ([[np.bool_(True)]], r"prompts\[0\] token id np.True_ at position 0 is not an integer \(got bool\)"),
        ([[np.float32(3.0)]], r"prompts\[0\] token id np.float32\(3.0\) at position 0 is not an integer"),
        (
            [[np.int64(2), np.int64(VOCAB)]],
            r"prompts\[0\] token id 256 at position 1 is out of the vocabulary \[0, 256\)",
        ),
        (torch.tensor([1.0, 2.0]), r"prompts\[0\] must hold integer token ids, got a tensor of torch.float32"),
        (torch.tensor([True, False]), r"prompts\[0\] must hold integer token ids, got a tensor of torch.bool"),
        (np.array([1.5, 2.0]), r"prompts\[0\] must hold integer token ids, got a numpy array of float64"),
        (torch.ones(2, 2, 2, dtype=torch.long), r"prompts as a Tensor must be 1-D .* got shape \(2, 2, 2\)"),
        (torch.tensor([3, VOCAB + 1]), r"prompts\[0\] token id 257 at position 1 is out of the vocabulary"),
        (torch.empty(0, dtype=torch.long), r"prompts\[0\] has no token ids"),
        ([torch.ones(1, 2, dtype=torch.long)], r"prompts\[0\] as a Tensor must be 1-D token ids, got shape \(1, 2\)"),
        (7, r"prompts must be a string, a sequence of token ids, a vLLM prompt dict, or a list of those; got int 7"),
        ([[1, 2], 7], r"prompts\[1\] must be a string, a sequence of token ids or a vLLM prompt dict, got int 7"),
        ([b"bytes"], r"prompts\[0\] must be a string, a sequence of token ids or a vLLM prompt dict, got bytes"),
    ],
)
def test_bad_token_prompts_name_the_prompt_and_value(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY)


@pytest.mark.parametrize(
    "prompts, match",
    [
        (["\udcff"], r"prompts\[0\] contains a lone surrogate '\\udcff' at position 0 that cannot be encoded as UTF-8"),
        (
            ["fine", "abc\ud800"],
            r"prompts\[1\] contains a lone surrogate '\\ud800' at position 3 that cannot be encoded",
        ),
    ],
)
def test_lone_surrogates_are_refused_naming_the_prompt_and_position(tiny_llm, prompts, match):
    llm, _ = tiny_llm
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY)
    with pytest.raises(ValueError, match=r"^prompt contains a lone surrogate"):
        llm.submit(prompts[-1], GREEDY)


def test_a_1d_tensor_or_array_is_one_prompt_and_2d_one_per_row(llm):
    first, second = random_prompts([7, 7], seed=5)
    expected = _tokens(llm, [first, second])
    assert _tokens(llm, torch.tensor(first)) == expected[:1]
    assert _tokens(llm, np.array(first)) == expected[:1]
    assert _tokens(llm, torch.tensor(first, dtype=torch.int32)) == expected[:1]
    assert _tokens(llm, torch.tensor([first, second])) == expected
    assert _tokens(llm, np.array([first, second], dtype=np.int32)) == expected
    assert _tokens(llm, [torch.tensor(first), np.array(second)]) == expected
    assert _tokens(llm, (prompt for prompt in [first, second])) == expected


def test_numpy_and_0d_tensor_token_ids_are_token_ids(llm):
    prompt = random_prompts([8], seed=6)[0]
    expected = _tokens(llm, [prompt])
    assert _tokens(llm, [np.int64(t) for t in prompt]) == expected
    assert _tokens(llm, [[np.uint16(t) for t in prompt]]) == expected
    assert _tokens(llm, [torch.tensor(t) for t in prompt]) == expected
    assert _tokens(llm, tuple(np.int32(t) for t in prompt)) == expected
    assert llm.generate([np.int64(t) for t in prompt], GREEDY)[0].prompt_token_ids == prompt


def test_engine_serves_exact_solo_tokens_after_every_bad_call(llm):
    prompt = random_prompts([20], seed=4)[0]
    params = nnrun.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = _tokens(llm, [prompt], params)
    bad_calls = [
        lambda: llm.generate(torch.tensor([1.0])),
        lambda: llm.generate([[1, 2.5]]),
        lambda: llm.generate([[np.int64(VOCAB)]]),
        lambda: llm.generate(torch.ones(2, 2, 2, dtype=torch.long)),
        lambda: llm.generate([[1, 2]], nnrun.SamplingParams(temperature=NAN)),
        lambda: llm.generate([[1, 2]], nnrun.SamplingParams(repetition_penalty=NAN)),
        lambda: llm.generate([[1, 2]], nnrun.SamplingParams(seed=2**70)),
        lambda: llm.submit([1, True]),
        lambda: llm.generate([prompt, [np.float64(1.0)]]),  # one bad prompt fails the whole call before any runs
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    assert _tokens(llm, [prompt], params) == expected
    assert _tokens(llm, torch.tensor(prompt), params) == expected
    llm.runner.allocator.check_no_leaks()
    assert not llm.core.has_unfinished


# ---- LanguageModel trace and invoke inputs ---------------------------------------------------
def _trace_last_logits(lm, prompt) -> torch.Tensor:
    with lm.trace(prompt):
        logits = lm.lm_head.output[0, -1].save()
    return logits


def _invoke_last_logits(lm, prompt) -> torch.Tensor:
    with lm.trace() as tracer:
        with tracer.invoke(prompt):
            logits = lm.lm_head.output[0, -1].save()
    return logits


def _trace(lm, prompt) -> None:
    with lm.trace(prompt):
        lm.lm_head.output.save()


def _invoke(lm, prompt) -> None:
    with lm.trace() as tracer:
        with tracer.invoke("The Colosseum is in"):
            lm.lm_head.output.save()
        with tracer.invoke(prompt):
            lm.lm_head.output.save()


@pytest.mark.parametrize("run", [_trace, _invoke])
@pytest.mark.parametrize(
    "make_prompt, match",
    [
        (lambda ids: "abc\ud800", r"^input contains a lone surrogate '\\ud800' at position 3 that cannot be encoded"),
        (lambda ids: ["ok", "\udcff"], r"^input\[1\] contains a lone surrogate '\\udcff' at position 0"),
        (lambda ids: [ids[0], 2.5], r"^input token id 2.5 at position 1 is not an integer \(got float\)"),
        (lambda ids: [np.int64(ids[0]), np.int64(10**6)], r"^input token id 1000000 at position 1 is out of the vocab"),
        (lambda ids: torch.tensor(ids).float(), r"^input must hold integer token ids, got a tensor of torch.float32"),
        (lambda ids: torch.ones(1, 2, 3, dtype=torch.long), r"^input as a Tensor must be 1-D .* got shape \(1, 2, 3\)"),
        (lambda ids: [ids, [True]], r"^input\[1\] token id True at position 0 is not an integer"),
        (lambda ids: [], r"^input holds no prompts"),
        (
            lambda ids: {"input_ids": torch.tensor([ids]).float()},
            r"^input_ids must hold integer token ids, got a tensor",
        ),
        (
            lambda ids: {"input_ids": torch.tensor([ids]).float(), "attention_mask": torch.ones(1, len(ids))},
            r"^input_ids token id tensor\(.*\) at position 0 is not an integer",
        ),
        (lambda ids: {"input_ids": [ids], "attention_mask": [[1]]}, r"^attention_mask \(\[1\] positions per row\)"),
        (lambda ids: {"ids": ids}, r"^a dict input needs input_ids, got keys ids"),
    ],
)
def test_bad_trace_and_invoke_inputs_name_the_input(lm, run, make_prompt, match):
    ids = lm.tokenizer(FACT)["input_ids"]
    with pytest.raises(ValueError, match=match):
        run(lm, make_prompt(ids))


def test_tensor_numpy_and_dict_trace_inputs_match_the_token_list(lm):
    ids = lm.tokenizer(FACT)["input_ids"]
    expected = _trace_last_logits(lm, ids)
    assert torch.equal(_trace_last_logits(lm, FACT), expected)
    padded = lm.tokenizer(["x " * 12, FACT], padding=True, return_tensors="pt")
    for same in (
        torch.tensor(ids),
        torch.tensor([ids]),
        np.array(ids),
        [np.int64(t) for t in ids],
        [torch.tensor(t) for t in ids],
        {"input_ids": torch.tensor([ids])},
        {"input_ids": np.array(ids)},
    ):
        assert torch.equal(_trace_last_logits(lm, same), expected), type(same)
        assert torch.equal(_invoke_last_logits(lm, same), expected), type(same)
    with lm.trace(padded):
        logits = lm.lm_head.output[:, -1].save()
    assert_close_packed(logits[1], expected)  # padded batch against alone: summation order only
    assert lm._batch_size(torch.tensor(ids)) == 1 and lm._batch_size(torch.tensor([ids, ids])) == 2
    assert lm._batch_size([np.int64(t) for t in ids]) == 1 and lm._batch_size(padded) == 2


def test_the_model_keeps_tracing_after_bad_inputs(lm):
    ids = lm.tokenizer(FACT)["input_ids"]
    expected = _trace_last_logits(lm, FACT)
    for bad in ("\udcff", [ids[0], 0.5], torch.tensor([1.0]), [10**6]):
        with pytest.raises(ValueError):
            _trace(lm, bad)
        with pytest.raises(ValueError):
            _invoke(lm, bad)
    with pytest.raises(ValueError, match=re.escape("SamplingParams.temperature must be a finite number")):
        lm.generate(FACT, max_new_tokens=2, do_sample=True, temperature=NAN)
    assert torch.equal(_trace_last_logits(lm, FACT), expected)
    assert torch.equal(lm.generate(FACT, max_new_tokens=3), lm.generate(np.array(ids), max_new_tokens=3))
    runner = lm.engine.runner
    runner.allocator.check_no_leaks()
    assert runner.interleaver.mediators == [] and not lm.engine.core.has_unfinished
