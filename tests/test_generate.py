"""Greedy generation equals HF generate, under queueing and preemption; streaming, stops, seeds."""

from __future__ import annotations

import threading

import pytest
import torch

import nnrun
from model_zoo import make_model, make_twin, random_prompts


@pytest.fixture(scope="module")
def llama_pair():
    model = make_model("llama")
    return model, make_twin(model)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_greedy_equals_hf_generate_with_queueing_and_preemption(family):
    model = make_model(family)
    oracle = make_twin(model)
    lengths = [3, 60, 11, 45, 1, 30, 52, 8, 17, 40, 25, 6, 58, 14, 33, 20]
    prompts = random_prompts(lengths, seed=11)
    max_new = 12
    # 4 running requests of up to 72 tokens need ~300 slots; 160 forces preemption.
    with nnrun.LLM(model, page_size=4, max_total_tokens=160, max_num_seqs=4) as llm:
        outputs = llm.generate(prompts, nnrun.SamplingParams(max_tokens=max_new, temperature=0))
        assert llm.core.scheduler.num_preemptions > 0
        llm.runner.allocator.check_no_leaks()
        assert llm.runner.req_to_token_pool.num_free_rows == llm.config.scheduler.max_num_seqs + 1
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(oracle, prompt, max_new)[: len(output.outputs[0].token_ids)]
        assert output.prompt_token_ids == prompt


def test_outputs_follow_prompt_order_and_vllm_shape(llama_pair):
    model, _ = llama_pair
    prompts = random_prompts([9, 2, 30], seed=2)
    with nnrun.LLM(model) as llm:
        outputs = llm.generate(prompts, nnrun.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [o.prompt_token_ids for o in outputs] == prompts
    for output in outputs:
        completion = output.outputs[0]
        assert output.finished and completion.finish_reason == "length" and len(completion.token_ids) == 3


def test_stop_token_ids_and_eos(llama_pair):
    model, oracle = llama_pair
    prompt = random_prompts([12], seed=5)[0]
    greedy = hf_greedy(oracle, prompt, 8)
    stop_at = greedy[3]
    with nnrun.LLM(model) as llm:
        out = llm.generate([prompt], nnrun.SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at]))[0]
    first = greedy.index(stop_at)
    assert out.outputs[0].token_ids == greedy[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_streaming_yields_each_token_then_the_final_output(llama_pair):
    model, oracle = llama_pair
    prompt = random_prompts([10], seed=6)[0]
    with nnrun.LLM(model) as llm:
        chunks = list(llm.generate_stream(prompt, nnrun.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
    assert [len(c.outputs[0].token_ids) for c in chunks] == [1, 2, 3, 4, 5]
    assert chunks[-1].finished and not chunks[0].finished
    assert chunks[-1].outputs[0].token_ids == hf_greedy(oracle, prompt, 5)


def test_same_seed_same_tokens_whatever_the_batch(llama_pair):
    model, _ = llama_pair
    prompts = random_prompts([8, 20, 4], seed=9)
    seeded = nnrun.SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    with nnrun.LLM(model) as llm:
        alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
        mixed = llm.generate(
            prompts,
            [
                nnrun.SamplingParams(max_tokens=10, temperature=1.0),
                seeded,
                nnrun.SamplingParams(max_tokens=10, temperature=0),
            ],
        )
        batched = llm.generate([prompts[1], prompts[0]], [nnrun.SamplingParams(max_tokens=10), seeded])[1]
        other_seed = llm.generate(
            [prompts[0]], nnrun.SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
        )[0]
    assert batched.outputs[0].token_ids == alone
    assert mixed[1].prompt_token_ids == prompts[1]
    assert other_seed.outputs[0].token_ids != alone


def test_concurrent_callers_share_the_engine(llama_pair):
    model, oracle = llama_pair
    prompts = random_prompts([5, 15, 25, 35, 45, 55], seed=13)
    results: dict[int, list[int]] = {}
    with nnrun.LLM(model, max_num_seqs=8) as llm:

        def call(i: int) -> None:
            out = llm.generate([prompts[i]], nnrun.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            results[i] = out[0].outputs[0].token_ids

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        llm.runner.allocator.check_no_leaks()
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(oracle, prompt, 6)


def test_text_prompts_and_stop_strings_with_a_tokenizer(tiny_llm):
    llm, tokenizer = tiny_llm
    full = llm.generate("The", nnrun.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    text = full.outputs[0].text
    assert text == tokenizer.decode(full.outputs[0].token_ids, skip_special_tokens=True)
    stop = text.strip()[:2]
    if not stop:
        pytest.skip("the model generated only whitespace")
    out = llm.generate("The", nnrun.SamplingParams(max_tokens=12, temperature=0, stop=stop, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert stop not in out.outputs[0].text and text.startswith(out.outputs[0].text)


def test_min_tokens_masks_eos_like_hf_min_new_tokens():
    """tiny-facts ends " Paris." with EOS; min_tokens keeps it going exactly as HF's min_new_tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnrun.assets import bundled_model_path

    path = bundled_model_path("tiny-facts")
    oracle, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    ids = tokenizer("The Eiffel Tower is in", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        free = oracle.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1] :].tolist()
        held = oracle.generate(ids, max_new_tokens=10, min_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert len(free) < 8 and free[-1] == tokenizer.eos_token_id  # the oracle really stops early
    with nnrun.LLM("tiny-facts") as llm:
        prompt = ids[0].tolist()
        stops = llm.generate([prompt], nnrun.SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
        longer = llm.generate([prompt], nnrun.SamplingParams(max_tokens=10, min_tokens=8, temperature=0))[0].outputs[0]
    assert stops.token_ids == free and stops.finish_reason == "stop"
    assert longer.token_ids == held[: len(longer.token_ids)] and len(longer.token_ids) >= 8


def test_step_counters_count_forwards_requests_and_tokens(llama_pair):
    model, _ = llama_pair
    prompts = random_prompts([3, 5], seed=4)
    with nnrun.LLM(model) as llm:
        assert llm.step_counters() == {
            "forwards": 0,
            "batched_requests": 0,
            "forwarded_tokens": 0,
            "finished_requests": 0,
        }
        llm.generate(prompts, nnrun.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        # One prefill of both prompts (3 + 5 tokens), then two decode steps of one token each per prompt.
        assert llm.step_counters() == {
            "forwards": 3,
            "batched_requests": 6,
            "forwarded_tokens": 8 + 2 + 2,
            "finished_requests": 2,
        }
        llm.generate([prompts[0]], nnrun.SamplingParams(max_tokens=1, temperature=0))
        assert llm.step_counters() == {
            "forwards": 4,
            "batched_requests": 7,
            "forwarded_tokens": 15,
            "finished_requests": 3,
        }
