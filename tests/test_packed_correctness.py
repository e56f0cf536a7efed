"""Packed execution equals each prompt run alone through plain HF, for every supported family."""

from __future__ import annotations

import pytest
import torch

import nnrun
from model_zoo import FAMILIES, hf_logits, make_model, make_twin, random_prompts
from tolerance import assert_close_packed

TOL = 1e-4  # relative to the values' magnitude: packed and solo sum in other orders
LENGTHS = [1, 7, 33, 64, 100, 150, 199, 200]


@pytest.fixture(scope="module", params=FAMILIES)
def family_pair(request):
    model = make_model(request.param)
    return request.param, model, make_twin(model)


def test_prefill_prompt_logprobs_and_next_token_match_hf(family_pair):
    family, model, oracle = family_pair
    prompts = random_prompts(LENGTHS)
    with nnrun.LLM(model, page_size=16) as llm:
        params = nnrun.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, logprobs=0)
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        expected = torch.log_softmax(hf_logits(oracle, prompt), dim=-1)  # [T, V]
        got = [entry[token] for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
        want = [expected[i, token].item() for i, token in enumerate(prompt[1:])]
        assert output.prompt_logprobs[0] is None
        assert_close_packed(torch.tensor(got), torch.tensor(want), rel=TOL, msg=family)
        token = output.outputs[0].token_ids[0]
        assert token == expected[-1].argmax().item()
        assert abs(output.outputs[0].logprobs[0][token] - expected[-1, token].item()) < TOL


def test_next_token_logits_rows_match_hf(family_pair):
    """The raw logits the runner hands the sampler, one row per request, equal HF's last-position logits."""
    family, model, oracle = family_pair
    prompts = random_prompts([3, 50, 1, 120], seed=7)
    with nnrun.LLM(model, page_size=8) as llm:
        runner = llm.runner
        reqs = [llm.make_request(p, nnrun.SamplingParams(max_tokens=1)) for p in prompts]
        for req in reqs:
            req.page_ids = runner.allocator.alloc(runner.allocator.pages_needed(req.num_tokens))
            req.req_pool_idx = runner.req_to_token_pool.alloc()
        forward_batch = runner.prepare_forward_batch_extend(reqs)
        logits = runner.forward(forward_batch).next_token_logits  # [B, V]
        for req in reqs:
            runner.release_kv(req)
    for row, prompt in enumerate(prompts):
        assert_close_packed(logits[row], hf_logits(oracle, prompt)[-1], rel=TOL, msg=family)


def test_decode_steps_mixed_with_prefills_match_hf(family_pair):
    """Greedy tokens and their logprobs over decode steps that share forwards with new prefills."""
    family, model, oracle = family_pair
    prompts = random_prompts([5, 40, 2, 90, 17, 60], seed=3)
    with nnrun.LLM(model, page_size=4, max_num_batched_tokens=64) as llm:  # admits prompts over several steps
        outputs = llm.generate(prompts, nnrun.SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        expected = torch.log_softmax(hf_logits(oracle, prompt + tokens), dim=-1)
        for i, token in enumerate(tokens):
            position = len(prompt) - 1 + i
            assert token == expected[position].argmax().item(), family
            assert abs(output.outputs[0].logprobs[i][token] - expected[position, token].item()) < TOL


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2"])
def test_window_and_softcap_settings_really_bind(family):
    """Negative control: these configs' windows/softcaps change results, so the tests above can fail."""
    model = make_model(family)
    oracle = make_twin(model)
    loose = make_twin(model)
    loose.config.sliding_window = 10_000  # longer than any prompt: the window never binds
    if hasattr(loose.config, "layer_types"):
        loose.config.layer_types = ["full_attention"] * loose.config.num_hidden_layers
    if family == "gemma2":
        loose.config.attn_logit_softcapping = None
    loose = make_twin(loose)
    prompt = random_prompts([120])[0]
    assert (hf_logits(oracle, prompt) - hf_logits(loose, prompt)).abs().max() > 1e-3
