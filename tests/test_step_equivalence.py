"""A mixed workload's tokens equal a per-request replay through plain HF and the per-row sampler (issue 36).

The engine's step has batch-wide fast paths (shared sampling parameters, vectorised bookkeeping,
incremental decode inputs); whatever path a step takes, each request's tokens must be exactly what
its own logits and its own generator give, one row at a time, and its stop exactly today's:
greedy, seeded sampling with temperature/top-p/top-k/min-p, penalties, logprobs, stop strings,
stop tokens, EOS, min_tokens, max_tokens, preemption in a small KV pool, and an abort mid-decode.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnrun
from nnrun.assets import bundled_model_path
from nnrun.request import FinishReason, Request
from nnrun.sampler import Sampler, SamplingRow

P = nnrun.SamplingParams
TEXTS = [
    "The Eiffel Tower is in",
    "The Louvre Museum is in",
    "The cat sat on the",
    "Paris is the capital of",
    "A dog ran in the",
    "The Colosseum is in",
    "Rome is in",
    "The park is",
]


@pytest.fixture(scope="module")
def oracle():
    return AutoModelForCausalLM.from_pretrained(bundled_model_path("tiny-facts")).eval()


def workload(shared: bool) -> list[P]:
    """Parameters per prompt; with `shared`, rows of the same settings hold one SamplingParams object."""
    greedy = P(max_tokens=14, temperature=0)
    greedy_long = P(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = P(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    params = [
        greedy,
        greedy if shared else P(max_tokens=14, temperature=0),
        greedy_long,
        greedy_long if shared else P(max_tokens=12, temperature=0, ignore_eos=True),
        seeded,
        seeded if shared else P(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        P(max_tokens=9, temperature=1.0, top_k=5, seed=11, logprobs=0),
        P(max_tokens=9, temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, seed=3, logprobs=3),
        P(max_tokens=12, temperature=0, min_tokens=9),
        P(max_tokens=12, temperature=0, logprobs=2, stop=["ari"]),
        P(max_tokens=8, temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.5, seed=5),
        P(max_tokens=10, temperature=0, stop_token_ids=[17, 42], ignore_eos=True),
        P(max_tokens=40, temperature=0.9, seed=13, ignore_eos=True),  # aborted mid-decode
    ]
    return params


ABORTED = 12


def run_engine(params: list[P], aborted: int | None = ABORTED) -> list[Request]:
    """Drive the engine's core step by step on this thread (deterministic batches, preemption, an abort)."""
    with nnrun.LLM("tiny-facts", page_size=4, max_total_tokens=64, max_num_seqs=6) as llm:
        reqs = [llm.make_request(TEXTS[i % len(TEXTS)], p, request_id=str(i)) for i, p in enumerate(params)]
        core = llm.core
        for req in reqs:
            core.add_request(req)
        steps = 0
        while core.has_unfinished:
            core.step()
            steps += 1
            if aborted is not None and len(reqs[aborted].output_token_ids) >= 3 and not reqs[aborted].is_finished:
                core.abort_requests({reqs[aborted].request_id: RuntimeError("aborted")})
            assert steps < 500
        assert core.scheduler.num_preemptions > 0  # the small pool preempted and recomputed requests
        llm.runner.allocator.check_no_leaks()
        for req in reqs:
            req.text = core.stop_checker.final_text(req)
        return reqs


@torch.no_grad()
def replay(oracle, req: Request, eos_ids: set[int]) -> tuple[list[int], list[dict[int, float] | None]]:
    """The request's tokens one at a time: HF's logits of its own sequence, min_tokens masking, one-row sampling."""
    params = req.sampling_params
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    tokens, logprobs = [], []
    sampler = Sampler()
    for _ in range(len(req.output_token_ids)):
        ids = torch.tensor([req.prompt_token_ids + tokens])
        logits = oracle(ids).logits[0, -1:].float()  # [1, V]
        if len(tokens) < params.min_tokens:
            logits = logits.clone()
            logits[0, [t for t in {*eos_ids, *params.stop_token_ids}]] = float("-inf")
        row = SamplingRow(params, req.prompt_token_ids, list(tokens), generator)
        out = sampler(logits, [row])
        token = int(out.token_ids[0])
        tokens.append(token)
        if out.logprobs is None:
            logprobs.append(None)
            continue
        entry = {}
        if params.logprobs:
            entry.update(zip(out.top_logprob_ids[0].tolist(), out.top_logprobs[0].tolist()))
        entry[token] = float(out.logprobs[0])
        logprobs.append(entry)
    return tokens, logprobs


def expected_finish(req: Request, eos_ids: set[int], tokenizer) -> FinishReason:
    params, out = req.sampling_params, req.output_token_ids
    last = out[-1]
    if len(out) >= params.min_tokens:
        if (not params.ignore_eos and last in eos_ids) or last in params.stop_token_ids:
            return FinishReason.STOP
        text = tokenizer.decode(out, skip_special_tokens=True)
        if any(stop in text for stop in params.stop_strings):
            return FinishReason.STOP
    assert len(out) == params.max_tokens, "a request that stopped for no reason"
    return FinishReason.LENGTH


def test_mixed_workload_equals_per_request_replay(oracle):
    reqs = run_engine(workload(shared=True))
    check_against_replay(oracle, reqs)
    stopped = reqs[9]  # " Paris": the stop string ends it inside a token, cuts the text and is its stop reason
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == "ari" and stopped.text == " P"


@pytest.mark.parametrize(
    "params",
    [
        P(max_tokens=12, temperature=0),  # one argmax for the whole batch
        P(max_tokens=12, temperature=0, min_tokens=5, logprobs=1),  # per-row min_tokens mask, batched logprobs
    ],
)
def test_batches_under_one_params_object_equal_per_request_replay(oracle, params):
    """Every running request holds the same SamplingParams: the step samples the batch in whole-batch ops."""
    check_against_replay(oracle, run_engine([params] * 10, aborted=None))


def check_against_replay(oracle, reqs: list[Request]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path("tiny-facts"))
    eos_ids = {tokenizer.eos_token_id}
    for req in reqs:
        out = req.output_token_ids
        if req.request_id == str(ABORTED):
            assert req.finish_reason is FinishReason.ABORT and 3 <= len(out) < 40
        else:
            assert req.error is None and req.finish_reason is expected_finish(req, eos_ids, tokenizer), req.request_id
        tokens, logprobs = replay(oracle, req, eos_ids)
        assert out == tokens, req.request_id  # bitwise: the same tokens, greedy or seeded
        if req.sampling_params.logprobs is None:
            assert req.output_logprobs == []
            continue
        assert len(req.output_logprobs) == len(out)
        for ours, theirs in zip(req.output_logprobs, logprobs):
            assert ours.keys() == theirs.keys()
            assert all(abs(ours[t] - theirs[t]) < 1e-4 for t in ours)
        # every token stops no earlier than the first that could: nothing in between matched a stop
        for n in range(1, len(out)):
            if n >= req.sampling_params.min_tokens:
                assert out[n - 1] not in eos_ids or req.sampling_params.ignore_eos


def test_shared_and_per_request_parameters_give_identical_outputs():
    """Rows holding one SamplingParams object take the batch-wide paths; distinct equal ones the per-row ones."""
    shared, separate = run_engine(workload(shared=True)), run_engine(workload(shared=False))
    for a, b in zip(shared, separate):
        assert a.output_token_ids == b.output_token_ids, a.request_id
        assert a.output_logprobs == b.output_logprobs  # bitwise: the same float values
        assert (a.finish_reason, a.stop_reason, a.text) == (b.finish_reason, b.stop_reason, b.text)
