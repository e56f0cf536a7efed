"""Multi-step decode (issue 36): several decode steps per scheduling decision give today's outputs bitwise.

The oracle is the same engine scheduling every step (`num_scheduler_steps=1`) on the same workload:
tokens, finish and stop reasons, texts and logprobs must be identical with windows of 4 and 8
steps. The workload is issue 36's mixed one (tests/test_step_equivalence.py) plus one whose requests
can all run in windows: EOS inside a window, max_tokens not a multiple of the window, min_tokens,
stop tokens, seeded sampling, logprobs, a small KV pool that preempts, and an abort. What needs the
host after every token (stop strings, streaming, penalties, a trace's blocks) falls back to one step
per decision; the windows must really run where nothing does (scheduling decisions < forwards).
"""

from __future__ import annotations

import time

import pytest
import torch

import nnrun
from nnrun.multi_step import decode_window_size
from nnrun.request import FinishReason, Request
from test_cuda_graphs import fake  # noqa: F401 (a fixture)
from test_step_equivalence import TEXTS, check_against_replay, oracle, workload  # noqa: F401 (a fixture)

P = nnrun.SamplingParams


def windowable_workload() -> list[P]:
    """Requests that may all run in windows: no stop strings, no penalties."""
    greedy = P(max_tokens=14, temperature=0)  # EOS stops some of these inside a window
    return [
        greedy,
        greedy,
        P(max_tokens=11, temperature=0, ignore_eos=True),  # not a multiple of 4 or 8
        P(max_tokens=13, temperature=0, ignore_eos=True, logprobs=2),
        P(max_tokens=12, temperature=1.0, seed=1),  # seeded, may stop on EOS inside a window
        P(max_tokens=12, temperature=1.0, seed=2),
        P(max_tokens=12, temperature=1.0, seed=4),
        P(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=0),
        P(max_tokens=9, temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, seed=3, logprobs=3),
        P(max_tokens=12, temperature=0, min_tokens=9),
        P(max_tokens=10, temperature=0, stop_token_ids=[17, 42], ignore_eos=True),
        P(max_tokens=15, temperature=0.9, seed=13, ignore_eos=True, min_tokens=3),
        P(max_tokens=40, temperature=0.9, seed=13, ignore_eos=True),  # aborted mid-decode
    ]


ABORTED = 12
ROOMY = dict(max_num_seqs=16, max_total_tokens=1024)  # every request runs from the start: no waiting, no preemption


def run_core(
    params: list[P], num_steps: int, aborted: int | None = ABORTED, texts: list[str] = TEXTS, **engine
) -> tuple[list[Request], dict]:
    """Drive the engine's core decision by decision on this thread; returns the requests and the counts."""
    options = dict(page_size=4, max_total_tokens=64, max_num_seqs=6) | engine
    with nnrun.LLM("tiny-facts", num_scheduler_steps=num_steps, **options) as llm:
        reqs = [llm.make_request(texts[i % len(texts)], p, request_id=str(i)) for i, p in enumerate(params)]
        core = llm.core
        for req in reqs:
            core.add_request(req)
        while core.has_unfinished:
            core.step()
            if aborted is not None and len(reqs[aborted].output_token_ids) >= 3 and not reqs[aborted].is_finished:
                core.abort_requests({reqs[aborted].request_id: RuntimeError("aborted")})
            assert core.scheduler.num_schedules < 500
        llm.runner.allocator.check_no_leaks()  # a window's KV beyond a stop is freed with its request
        for req in reqs:
            req.text = core.stop_checker.final_text(req)
        counts = dict(core.counters.snapshot(), schedules=core.scheduler.num_schedules)
        counts["preemptions"] = core.scheduler.num_preemptions
        return reqs, counts


# A row's float values depend on how many rows share its matmuls (neither the CPU's nor CUDA's kernels
# are batch-invariant). Rows that run on past a stop inside a window keep that count up for the
# window's rest, so the other rows' logprobs may differ in their last bits there; tokens may not.
ROUNDING = 1e-5


def assert_same_outputs(
    ours: list[Request], oracle: list[Request], aborted: int | None = ABORTED, logprob_tolerance: float = 0.0
) -> None:
    for a, b in zip(ours, oracle):
        if a.request_id == str(aborted):  # aborted between decisions: a window later, a longer prefix
            assert a.finish_reason is b.finish_reason is FinishReason.ABORT
            shorter = min(len(a.output_token_ids), len(b.output_token_ids))
            assert a.output_token_ids[:shorter] == b.output_token_ids[:shorter] and shorter >= 3
            continue
        assert a.output_token_ids == b.output_token_ids, a.request_id  # bitwise, greedy or seeded
        assert (a.finish_reason, a.stop_reason, a.text, a.error) == (b.finish_reason, b.stop_reason, b.text, None)
        if logprob_tolerance == 0.0:
            assert a.output_logprobs == b.output_logprobs, a.request_id  # the same float values
            continue
        assert [entry.keys() for entry in a.output_logprobs] == [entry.keys() for entry in b.output_logprobs]
        for ours_entry, theirs in zip(a.output_logprobs, b.output_logprobs):
            assert all(abs(ours_entry[t] - theirs[t]) <= logprob_tolerance for t in ours_entry), a.request_id


def no_early_stop_workload() -> list[P]:
    """Requests that cannot stop before max_tokens (no EOS, no stop tokens): windows run even while others wait."""
    return [
        P(max_tokens=11, temperature=0, ignore_eos=True),  # not a multiple of 4 or 8
        P(max_tokens=13, temperature=0, ignore_eos=True, logprobs=2),
        P(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=0),
        P(max_tokens=9, temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, seed=3, logprobs=3, ignore_eos=True),
        P(max_tokens=12, temperature=1.0, min_tokens=9, seed=5, ignore_eos=True, logprobs=1),
        P(max_tokens=15, temperature=0.9, seed=13, ignore_eos=True, min_tokens=3),
        P(max_tokens=17, temperature=0, ignore_eos=True, logprobs=1),
        P(max_tokens=14, temperature=1.0, seed=21, ignore_eos=True),
        P(max_tokens=24, temperature=0.9, seed=13, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def one_step_runs() -> dict[str, tuple[list[Request], dict]]:
    return {
        "windowable": run_core(windowable_workload(), 1),
        "mixed": run_core(workload(shared=True), 1),
        "no early stop": run_core(no_early_stop_workload(), 1, aborted=None),
    }


@pytest.mark.parametrize("num_steps", [4, 8])
def test_windows_where_no_request_can_stop_early_give_bitwise_outputs(one_step_runs, num_steps):
    """Every step's batch is the one-step engine's, waiting requests and preemptions included: the same floats.

    (No abort here: an abort lands at the next decision, a window later, and changes the batches after it.)
    """
    reference, one_step = one_step_runs["no early stop"]
    reqs, counts = run_core(no_early_stop_workload(), num_steps, aborted=None)
    assert_same_outputs(reqs, reference, aborted=None)
    assert (counts["forwards"], counts["batched_requests"]) == (one_step["forwards"], one_step["batched_requests"])
    assert one_step["schedules"] >= one_step["forwards"]  # one step per decision (some decide nothing)
    assert counts["schedules"] < 0.7 * counts["forwards"]  # the windows ran
    assert counts["preemptions"] > 0  # the small pool preempted and recomputed requests


@pytest.mark.parametrize("num_steps", [4, 8])
def test_windows_give_the_one_step_tokens_and_stops(one_step_runs, num_steps):
    """EOS, stop tokens and min_tokens too: tokens, stops and texts exact, logprobs to rounding."""
    reference, one_step = one_step_runs["windowable"]
    reqs, counts = run_core(windowable_workload(), num_steps)
    assert_same_outputs(reqs, reference, logprob_tolerance=ROUNDING)
    assert counts["schedules"] < 0.7 * counts["forwards"]  # the windows ran
    assert counts["preemptions"] > 0
    assert counts["batched_requests"] > one_step["batched_requests"]  # a row ran on past its EOS, then dropped


@pytest.mark.parametrize("num_steps", [1, 8])
def test_seeded_requests_stopping_inside_windows_draw_as_step_by_step(oracle, num_steps):  # noqa: F811
    """Sixteen seeds, each stopping on EOS after its own number of tokens, most inside a window of 8.

    A stopped request's rows run on to the window's end and draw from its generator; nothing reads
    those draws: every kept token is the per-request HF replay's, and the outputs are one-step's.
    """
    params = [P(max_tokens=12, temperature=1.0, seed=seed, logprobs=1) for seed in range(16)]
    reqs, counts = run_core(params, num_steps, aborted=None, texts=["The cat sat on the"], **ROOMY)
    lengths = [len(r.output_token_ids) for r in reqs]
    assert len(set(lengths)) > 4 and min(lengths) < 9  # stops spread over the window after the prefill
    assert sum(r.finish_reason is FinishReason.STOP for r in reqs) > 10
    check_against_replay(oracle, [r for r in reqs if r.request_id != str(ABORTED)])
    if num_steps > 1:
        assert counts["schedules"] <= 3 and counts["batched_requests"] > sum(lengths)  # rows rode past their stops
        reference, _ = run_core(params, 1, aborted=None, texts=["The cat sat on the"], **ROOMY)
        assert_same_outputs(reqs, reference, aborted=None, logprob_tolerance=ROUNDING)


def test_windows_equal_a_per_request_hf_replay(oracle):  # noqa: F811 (the fixture)
    """Not only equal to the one-step engine: each request's tokens are its own HF logits', one at a time."""
    reqs, counts = run_core(windowable_workload(), 4, aborted=None)
    check_against_replay(oracle, reqs[:ABORTED])
    assert counts["schedules"] < counts["forwards"]


@pytest.mark.parametrize("num_steps", [4, 8])
def test_the_mixed_workload_gives_the_one_step_outputs(one_step_runs, num_steps):
    """Stop strings and penalties in the batch: those decisions take one step; the outputs are one-step's."""
    reqs, _ = run_core(workload(shared=True), num_steps)
    assert_same_outputs(reqs, one_step_runs["mixed"][0], logprob_tolerance=ROUNDING)


def test_a_stop_string_or_penalty_in_the_batch_takes_one_step_per_decision():
    stop_string = P(max_tokens=12, temperature=0, stop=["zzz"], ignore_eos=True)
    penalty = P(max_tokens=12, temperature=0.8, seed=1, repetition_penalty=1.2, ignore_eos=True)
    for params in (stop_string, penalty):
        _, counts = run_core([params] * 3, 8, aborted=None, **ROOMY)
        assert counts["forwards"] == counts["schedules"] == 12  # the prefill, then 11 decisions of one step


def test_a_greedy_request_stops_on_eos_inside_a_window_as_hf_does():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnrun.assets import bundled_model_path

    path = bundled_model_path("tiny-facts")
    hf, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    ids = tokenizer("The Eiffel Tower is in", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1] :].tolist()
    assert len(expected) < 8 and expected[-1] == tokenizer.eos_token_id
    with nnrun.LLM("tiny-facts", num_scheduler_steps=8) as llm:
        out = llm.generate([ids[0].tolist()], P(max_tokens=10, temperature=0))[0].outputs[0]
        assert out.token_ids == expected and out.finish_reason == "stop"
        # the prefill, then one window of 8 (min(8, 10 - 1)): the steps after EOS ran and were dropped
        assert llm.step_counters()["forwards"] == 9 and llm.core.scheduler.num_schedules == 2
        llm.runner.allocator.check_no_leaks()


def test_streams_take_one_step_per_decision_and_see_every_token():
    with nnrun.LLM("tiny-facts", num_scheduler_steps=4) as llm:
        full = llm.generate([TEXTS[0]], P(max_tokens=9, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
        schedules = llm.core.scheduler.num_schedules
        stream = llm.generate_stream(TEXTS[0], P(max_tokens=9, temperature=0, ignore_eos=True))
        streamed = [out.outputs[0].token_ids for out in stream]
        assert [len(ids) for ids in streamed] == list(range(1, 10)) and streamed[-1] == full
        assert llm.core.scheduler.num_schedules - schedules >= 9  # each token its own decision


def test_abort_during_windows_ends_the_request_at_the_next_decision():
    with nnrun.LLM("tiny-facts", num_scheduler_steps=4) as llm:
        params = P(max_tokens=200, temperature=0, ignore_eos=True)
        full = llm.generate([TEXTS[1]], P(max_tokens=60, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
        handle = llm.submit(TEXTS[1], params)
        while len(handle.request.output_token_ids) < 5:
            time.sleep(0.001)
        llm.abort([handle.request_id])
        with pytest.raises(RuntimeError, match="aborted"):
            handle.result(timeout=60)
        tokens = handle.request.output_token_ids
        assert handle.request.finish_reason is FinishReason.ABORT and 5 <= len(tokens) < 200
        shorter = min(len(tokens), len(full))
        assert tokens[:shorter] == full[:shorter]
        llm.runner.allocator.check_no_leaks()


def test_window_size_is_the_least_any_request_has_left():
    class Runner:
        def allows_multi_step(self, reqs):
            return True

    def req(params: P, num_output: int, prompt_len: int = 4) -> Request:
        r = Request("r", list(range(prompt_len)), params)
        r.output_token_ids = [5] * num_output
        return r

    runner, max_len = Runner(), 100
    assert decode_window_size([req(P(max_tokens=20), 1)], 8, max_len, runner) == 8
    assert decode_window_size([req(P(max_tokens=20), 1), req(P(max_tokens=6), 1)], 8, max_len, runner) == 5
    assert decode_window_size([req(P(max_tokens=20, min_tokens=4), 1)], 8, max_len, runner) == 3  # mask stays on
    assert decode_window_size([req(P(max_tokens=20, min_tokens=4), 4)], 8, max_len, runner) == 8  # mask stays off
    assert decode_window_size([req(P(max_tokens=None), 1, prompt_len=95)], 8, max_len, runner) == 4  # context
    assert decode_window_size([req(P(max_tokens=20), 19)], 8, max_len, runner) == 1
    assert decode_window_size([req(P(max_tokens=20, stop=["x"]), 1)], 8, max_len, runner) == 1
    assert decode_window_size([req(P(max_tokens=20, presence_penalty=0.5), 1)], 8, max_len, runner) == 1
    streamed = req(P(max_tokens=20), 1)
    streamed.is_streamed = True
    assert decode_window_size([req(P(max_tokens=20), 1), streamed], 8, max_len, runner) == 1
    runner.allows_multi_step = lambda reqs: False
    assert decode_window_size([req(P(max_tokens=20), 1)], 8, max_len, runner) == 1


def test_a_window_holds_its_kv_up_front_from_free_pages_only():
    with nnrun.LLM("tiny-facts", page_size=4, num_pages=8, num_scheduler_steps=8) as llm:
        scheduler, allocator = llm.core.scheduler, llm.runner.allocator
        reqs = [llm.make_request([5, 6, 7], P(max_tokens=50)) for _ in range(2)]
        for r in reqs:
            llm.core.add_request(r)
        assert scheduler.schedule() is not None  # both admitted: one page each for their 3 prompt tokens
        for r in reqs:  # as after a prefill and two tokens: 5 tokens, 4 computed
            r.output_token_ids += [8, 9]
            r.num_computed_tokens = 4
        assert scheduler.schedule() is not None and allocator.num_free_pages == 4  # a page each for token 5
        # 8 steps write positions 4..11: 3 pages each, one more than held -> 2 of the 4 free pages
        assert scheduler.hold_decode_window(reqs, 8) == 8 and allocator.num_free_pages == 2
        # 16 more steps would need 4 more pages each: the window shrinks to what the free pages hold
        for r in reqs:
            r.output_token_ids += [1] * 8
            r.num_computed_tokens += 8
        assert scheduler.hold_decode_window(reqs, 8) == 4 and allocator.num_free_pages == 0
        assert scheduler.hold_decode_window(reqs, 8) == 4 and scheduler.num_preemptions == 0
        for r in reqs:
            r.output_token_ids += [1] * 4
            r.num_computed_tokens += 4
        assert scheduler.hold_decode_window(reqs, 8) == 1 and scheduler.num_preemptions == 0


def test_num_scheduler_steps_is_validated():
    from nnrun.config import SchedulerConfig

    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            SchedulerConfig(num_scheduler_steps=bad)


def test_a_traced_generation_steps_one_at_a_time_beside_windowed_requests():
    """A trace's blocks see each of its steps, as nnsight on HF does, while plain requests decode in windows."""
    import warnings

    from conformance.compare import assert_same
    from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin

    model, tokenizer = tiny_llama(seed=7), tiny_tokenizer()
    oracle = hf_language_model(twin(model), tokenizer)
    prompt = "the eiffel tower is in the city of"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = nnrun.LanguageModel(model, tokenizer=tokenizer, num_scheduler_steps=8)
        engine = ours.engine
        windows: list[list[Request]] = []
        run_window = engine.core._run_window
        engine.core._run_window = lambda reqs, num_steps: windows.append(list(reqs)) or run_window(reqs, num_steps)
        greedy = P(max_tokens=200, temperature=0)
        alone = engine.generate([prompt], greedy)[0].outputs[0].token_ids  # a plain request: windows
        plain = engine.submit(prompt, greedy)
        with oracle.generate(prompt, max_new_tokens=5) as tracer:
            expected = list().save()
            for _ in tracer.iter[:5]:
                expected.append(oracle.lm_head.output[:, -1])
        with ours.generate(prompt, max_new_tokens=5) as tracer:
            actual = list().save()
            for _ in tracer.iter[:5]:
                actual.append(ours.logits)
        assert_same(expected, actual)
        assert plain.result(timeout=60).outputs[0].token_ids == alone
        assert windows and all("nnsight" not in req.extra_args for reqs in windows for req in reqs)
        ours.shutdown()


def test_a_trace_decodes_in_windows_once_no_block_can_touch_a_step():
    """Blocks that finished, or wait only for the trace's end, see no step again: the rest of the trace decodes in
    windows, with the values and ids of nnsight on HF."""
    import warnings

    from conformance.compare import assert_same
    from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin

    model, tokenizer = tiny_llama(seed=7), tiny_tokenizer()
    oracle = hf_language_model(twin(model), tokenizer)
    prompts = ["the eiffel tower is in the city of", "the big old river"]

    def run(lm):
        with lm.generate(max_new_tokens=12, min_new_tokens=12, do_sample=False) as tracer:
            with tracer.invoke(prompts[0]):
                logits = list().save()
                for _ in tracer.iter[:3]:
                    logits.append(lm.lm_head.output[:, -1])
            with tracer.invoke(prompts[1]):
                pass
            with tracer.invoke():
                ids = tracer.result.save()
        return logits, ids

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = nnrun.LanguageModel(model, tokenizer=tokenizer, num_scheduler_steps=4)
        engine = ours.engine
        windows: list[list[int]] = []  # per window of a traced request: its requests' tokens so far
        run_window = engine.core._run_window

        def record(reqs, num_steps):
            if any("nnsight" in req.extra_args for req in reqs):
                windows.append([len(req.output_token_ids) for req in reqs])
            return run_window(reqs, num_steps)

        engine.core._run_window = record
        expected_logits, expected_ids = run(oracle)
        actual_logits, actual_ids = run(ours)
        ours.shutdown()
    assert_same(expected_logits, actual_logits)
    assert torch.equal(expected_ids.cpu(), actual_ids.cpu())
    assert windows, "the steps after the block's last read ran one per decision"
    assert min(windows[0]) >= 3, "a window ran while the first block still read the steps"


def test_windows_default_to_four_on_cuda_and_one_on_the_cpu():
    """The CPU default is benchmarks/step_overhead.py's measurement: a window gains nothing there. The CUDA
    default is the H200's (docs/gpu.md)."""
    from nnrun.config import EngineConfig
    from nnrun.multi_step import max_scheduler_steps

    assert max_scheduler_steps(EngineConfig.from_kwargs("tiny-facts")) == 1
    assert max_scheduler_steps(EngineConfig.from_kwargs("tiny-facts", num_scheduler_steps=6)) == 6
    config = EngineConfig.from_kwargs("tiny-facts")
    config.device.device = "cuda:0"  # the device field as a CUDA engine's (no GPU needed to read the default)
    assert max_scheduler_steps(config) == 4
    config.scheduler.num_scheduler_steps = 1
    assert max_scheduler_steps(config) == 1


def test_windows_replay_a_decode_graph_at_every_step_with_the_one_step_outputs(fake):
    """Graphs under the recording stand-in for CUDA's capture: each step of a window replays, fed the last one's tokens."""
    from model_zoo import random_prompts
    from test_cuda_graphs import capture_graphs, count_decode_steps, greedy_params
    from test_flashinfer_emulated import make_sharp_model

    model = make_sharp_model("llama")
    prompts = random_prompts([3, 17, 9, 1, 30, 12], seed=7)
    params = [greedy_params(n) for n in [2, 9, 4, 7, 12, 5]]
    runs = {}
    for num_steps in (1, 4):
        with nnrun.LLM(model, page_size=4, num_scheduler_steps=num_steps) as llm:
            capturer = capture_graphs(llm)
            counts = count_decode_steps(llm)
            outputs = llm.generate(prompts, params)
            llm.runner.allocator.check_no_leaks()
            completions = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
            runs[num_steps] = completions, counts, capturer.replays, llm.core.scheduler.num_schedules
    (one_step, one_counts, one_replays, one_schedules), (windowed, counts, replays, schedules) = runs[1], runs[4]
    assert windowed == one_step  # tokens and logprobs, bitwise: no request stops early, the batches are the same
    assert counts == one_counts and counts["eager"] == 0 and replays == one_replays == 11
    assert schedules < one_schedules


@pytest.mark.parametrize("num_steps", [1, 4])
def test_a_row_that_cannot_be_sampled_inside_a_window_fails_its_request_at_that_step(num_steps):
    """The sampler's row error at the 4th forward (3rd decode step): that request ends there, the others go on."""
    outcomes = {}
    for steps in (1, num_steps):
        with nnrun.LLM("tiny-facts", num_scheduler_steps=steps) as llm:
            sample, forwards = llm.runner.sample, []

            def sample_with_a_bad_row(logits_output, forward_batch):
                out = sample(logits_output, forward_batch)
                forwards.append(1)
                if len(forwards) == 4:
                    out.row_errors = {0: "its logits hold NaN"}
                return out

            llm.runner.sample = sample_with_a_bad_row
            with llm.paused():  # both prompts in the first step
                handles = [llm.submit(text, P(max_tokens=10, temperature=0, ignore_eos=True)) for text in TEXTS[:2]]
            with pytest.raises(ValueError, match="NaN"):
                handles[0].result(timeout=60)
            outcomes[steps] = [h.request.output_token_ids for h in handles], handles[1].result(timeout=60)
            llm.runner.allocator.check_no_leaks()
    (tokens, other), (one_step_tokens, one_step_other) = outcomes[num_steps], outcomes[1]
    assert len(tokens[0]) == 3 and tokens == one_step_tokens  # the prefill's token and two decode steps kept
    assert other.outputs[0].token_ids == one_step_other.outputs[0].token_ids and len(tokens[1]) == 10


@pytest.mark.parametrize("max_model_len", [14, 17])
def test_windows_stop_at_the_context_length_as_single_steps_do(max_model_len):
    results = []
    for num_steps in (1, 8):
        with nnrun.LLM("tiny-facts", max_model_len=max_model_len, num_scheduler_steps=num_steps) as llm:
            outputs = llm.generate(TEXTS[:3], P(max_tokens=None, temperature=0, ignore_eos=True))
            results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs])
            llm.runner.allocator.check_no_leaks()
    assert results[0] == results[1]
    assert all(reason == "length" for _, reason in results[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_windows_give_the_one_step_tokens_on_flashinfer_graphs():
    """On CUDA (FlashInfer, real decode graphs): windows of 4 steps give the one-step engine's tokens and
    logprobs bitwise, with fewer scheduling decisions, and leave no KV slot behind."""
    from model_zoo import random_prompts
    from test_cuda_graphs import greedy_params
    from test_gpu_flashinfer import gpu_model

    model = gpu_model("llama_hd128", torch.bfloat16).to("cuda")  # benchmarks/gpu.py's 8B kernels: compiled once
    prompts = random_prompts([3, 17, 9, 1, 30, 12], seed=7)
    params = [greedy_params(n) for n in [2, 9, 4, 7, 12, 5]]
    runs = {}
    for num_steps in (1, 4):
        with nnrun.LLM(model, device="cuda", dtype=torch.bfloat16, num_scheduler_steps=num_steps) as llm:
            assert llm.runner.attn_backend.name == "flashinfer" and llm.runner.graph_runner is not None
            outputs = llm.generate(prompts, params)
            llm.runner.allocator.check_no_leaks()
            completions = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
            runs[num_steps] = completions, llm.core.scheduler.num_schedules
    (one_step, one_schedules), (windowed, schedules) = runs[1], runs[4]
    assert windowed == one_step
    assert schedules < one_schedules


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_windows_planned_ahead_of_a_lagging_gpu_give_the_one_step_tokens():
    """A window plans step N+1 while the GPU may not yet have read step N's plan: here the GPU is held
    behind the host at every step (a sleep kernel queued first), so each plan lands while the last one's
    copy waits in the stream. No FlashInfer wrapper keeps a pinned host plan buffer (a queued copy from
    one would read the next step's plan), and the tokens and logprobs are the one-step engine's."""
    from model_zoo import random_prompts
    from test_cuda_graphs import greedy_params
    from test_gpu_flashinfer import gpu_model

    model = gpu_model("llama_hd128", torch.bfloat16).to("cuda")
    prompts = random_prompts([40, 3, 70, 17, 129, 33], seed=11)  # kv lengths crossing pages inside windows
    params = [greedy_params(n) for n in [21, 9, 24, 13, 20, 17]]
    runs = {}
    for num_steps in (1, 4):
        with nnrun.LLM(model, device="cuda", dtype=torch.bfloat16, num_scheduler_steps=num_steps) as llm:
            backend = llm.runner.attn_backend
            wrappers = [w for w in backend.prefill_wrappers + backend.decode_wrappers if w is not None]
            wrappers += [w for group in backend.graph_decode_wrappers.values() for w in group]
            assert wrappers and not any(w._pin_memory_int_workspace_buffer.is_pinned() for w in wrappers)
            run_model = llm.runner.run_model

            def lagging(forward_batch, run_model=run_model):
                torch.cuda._sleep(5_000_000)  # a few ms of GPU time ahead of the step's copies and kernels
                return run_model(forward_batch)

            llm.runner.run_model = lagging
            outputs = llm.generate(prompts, params)
            llm.runner.allocator.check_no_leaks()
            runs[num_steps] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    assert runs[4] == runs[1]
