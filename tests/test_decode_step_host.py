"""The decode step's host shortcuts: a chain's advanced layout equals a fresh one, unwatched decode steps run in
inference mode with HF's tokens, and no inference tensor reaches user code or outlives its step."""

import pytest
import torch

import nnrun
from model_zoo import hf_logits, make_model, make_twin, random_prompts
from nnrun.forward_batch import ForwardMode, decode_forward_batch, next_decode_forward_batch, packed_forward_batch
from nnrun.memory import ReqToTokenPool, TokenToKVPoolAllocator, hold_kv
from nnrun.request import Request
from nnrun.sampling_params import SamplingParams

PAGE_SIZE = 4


def _prefilled(lengths: list[int]) -> tuple[list[Request], ReqToTokenPool, TokenToKVPoolAllocator]:
    allocator, table = TokenToKVPoolAllocator(64, PAGE_SIZE), ReqToTokenPool(8, 128)
    allocator.alloc(3)  # pages 0..2 taken: the requests' pages do not start at 0
    reqs = []
    for i, length in enumerate(lengths):
        req = Request(str(i), list(range(10 + i, 10 + i + length)), SamplingParams())
        assert hold_kv(req, length, allocator, table)
        reqs.append(req)
        allocator.alloc(1)  # a page between requests: a request's pages are not adjacent
    packed_forward_batch(reqs, ForwardMode.EXTEND, table.req_to_token, PAGE_SIZE, [False] * len(reqs))
    for req in reqs:  # the prefill ran; each request appends its first token
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(5)
    return reqs, table, allocator


@pytest.mark.parametrize("lengths", [[3], [4], [9, 6, 13], [5, 5, 5], [2, 7]])
def test_a_decode_chain_advances_to_the_layout_built_from_scratch(lengths):
    """Across page boundaries (page size 4: a boundary every few steps, at different steps per request)."""
    reqs, table, allocator = _prefilled(lengths)
    for req in reqs:
        assert hold_kv(req, req.num_tokens, allocator, table)
    chain = decode_forward_batch(reqs, table.req_to_token, PAGE_SIZE)
    for step in range(11):
        sampled = torch.tensor([7 + step + row for row in range(len(reqs))])  # [B]
        for req, token in zip(reqs, sampled.tolist()):
            req.num_computed_tokens = req.num_tokens
            req.output_token_ids.append(token)
            assert hold_kv(req, req.num_tokens, allocator, table)  # the scheduler's page for the new position
        chain = next_decode_forward_batch(chain, sampled, table.req_to_token, PAGE_SIZE)
        fresh = decode_forward_batch(reqs, table.req_to_token, PAGE_SIZE)
        for name in ("input_ids", "positions", "out_cache_loc", "logits_indices", "kv_slot_table"):
            assert torch.equal(getattr(chain, name), getattr(fresh, name)), (step, name)
        assert chain.prefix_lens == fresh.prefix_lens
        assert chain.num_steps_in_pages == fresh.num_steps_in_pages, step
        assert chain.logits_of_every_token and fresh.logits_of_every_token


def _inference_mode_of_attention(llm: nnrun.LLM) -> list[tuple[str, bool]]:
    """Records, per attention call, the step's mode and whether inference mode was on."""
    calls = []
    backend = llm.runner.attn_backend
    forward = backend.forward

    def recorded(*args, **kwargs):
        calls.append((backend.metadata.mode.value, torch.is_inference_mode_enabled()))
        return forward(*args, **kwargs)

    backend.forward = recorded
    return calls


def test_unwatched_decode_steps_run_in_inference_mode_with_hf_tokens_and_logprobs():
    model = make_model("llama")
    oracle = make_twin(model)
    prompts = random_prompts([5, 11, 3], seed=3)
    params = nnrun.SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
    with nnrun.LLM(model, page_size=4, attention_backend="torch") as llm:
        calls = _inference_mode_of_attention(llm)
        outputs = llm.generate(prompts, params)
    assert {mode for mode, on in calls if on} == {"decode"}  # prefills run as before
    assert all(on for mode, on in calls if mode == "decode")
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        logits = hf_logits(oracle, prompt + tokens[:-1])[len(prompt) - 1 :]  # [T, V] HF's own forward
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        assert tokens == logits.argmax(-1).tolist()
        got = [entry[token] for entry, token in zip(output.outputs[0].logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(got), logprobs[range(len(tokens)), tokens], rtol=0, atol=1e-4)


def test_hooked_steps_hand_user_code_ordinary_tensors_and_the_engine_goes_on_after():
    """A step a hook watches runs outside inference mode; steps before and after it share the pools."""
    model = make_model("llama")
    oracle = make_twin(model)
    prompt = random_prompts([6], seed=4)[0]
    params = nnrun.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with nnrun.LLM(model, page_size=4, attention_backend="torch") as llm:
        before = llm.generate([prompt], params)[0].outputs[0].token_ids  # unwatched: decode in inference mode
        seen = []
        handle = model.model.layers[0].register_forward_hook(lambda module, args, output: seen.append(output))
        try:
            watched = llm.generate([prompt], params)[0].outputs[0].token_ids
        finally:
            handle.remove()
        after = llm.generate([prompt], params)[0].outputs[0].token_ids
        pool = llm.runner.kv_pool
        assert not any(t.is_inference() for t in pool.k_pages + pool.v_pages)
    want = hf_logits(oracle, prompt + before[:-1])[len(prompt) - 1 :].argmax(-1).tolist()
    assert before == watched == after == want
    values = [out[0] if isinstance(out, tuple) else out for out in seen]
    assert values and not any(value.is_inference() for value in values)
    values[-1].add_(1)  # a saved value is an ordinary tensor: it can be edited in place
