"""nnsight's generation surface on nnrun, against nnsight on HF: `model.generator`, its streamer, HF streamers,
and generation keywords on `trace`."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

from conformance.compare import assert_same
from conformance.models import oracle_and_nnrun, tiny_llama, tiny_tokenizer

P = "the eiffel tower is in the city of"  # 8 tokens
Q = "hello world"  # 2 tokens: padded to P's length in a batch with it
R = "the cat sat on the mat"
WAIT_S = 30.0  # bound on every wait below; the waits end in milliseconds when nnrun behaves


@pytest.fixture(scope="module")
def models():
    oracle, ours = oracle_and_nnrun(tiny_llama(seed=7), tiny_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield oracle, ours
    ours.shutdown()


def both(models, scenario):
    """Run `scenario(model)` on nnsight-on-HF and on nnrun; return (HF's, nnrun's)."""
    oracle, ours = models
    return scenario(oracle), scenario(ours)


class Recorder(BaseStreamer):
    """An HF streamer that records HF's calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(("put", tuple(value.shape), value.dtype, value.tolist()))

    def end(self) -> None:
        self.calls.append(("end",))


# ---- model.generator ----------------------------------------------------------------------
def test_generator_output_is_the_generated_ids_and_the_result(models):
    def scenario(model):
        with model.generate(P, max_new_tokens=3) as tracer:
            ids = model.generator.output.save()
            result = tracer.result.save()
        return {"ids": ids, "result": result}

    expected, actual = both(models, scenario)
    assert actual["ids"].shape == (1, 11)
    assert_same(expected, actual)


def test_generator_output_warns_as_nnsight_deprecates_it(models):
    _, ours = models
    from nnsight import NNsightDeprecationWarning

    with pytest.warns(NNsightDeprecationWarning, match="model.generator.output is deprecated"):
        with ours.generate(P, max_new_tokens=1):
            ours.generator.output.save()


def test_streamer_gives_the_prompt_then_each_new_token(models):
    def scenario(model):
        with model.generate(P, max_new_tokens=3) as tracer:
            calls = list().save()
            for step in tracer.iter[:4]:
                calls.append(model.generator.streamer.output)
        return calls

    expected, actual = both(models, scenario)
    assert [tuple(t.shape) for t in actual] == [(1, 8), (1,), (1,), (1,)]
    assert_same(expected, actual)


def test_an_open_loop_over_the_streamer_ends_as_nnsights(models):
    def scenario(model):
        with pytest.warns(UserWarning, match="was never reached"):
            with model.generate(P, max_new_tokens=2) as tracer:
                calls = list().save()
                for step in tracer.iter[:]:
                    calls.append(model.generator.streamer.output)
        return calls

    expected, actual = both(models, scenario)
    assert len(actual) == 3
    assert_same(expected, actual)


def test_several_invokes_read_their_rows_padded_to_the_whole_batch(models):
    def scenario(model):
        with model.generate(max_new_tokens=3) as tracer:
            with tracer.invoke(P):
                a_calls = list().save()
                for step in tracer.iter[:4]:
                    a_calls.append(model.generator.streamer.output)
                a_ids = model.generator.output.save()
                a_result = tracer.result.save()
            with tracer.invoke(Q):
                b_calls = list().save()
                for step in tracer.iter[:4]:
                    b_calls.append(model.generator.streamer.output)
                b_ids = model.generator.output.save()
                b_result = tracer.result.save()
        return {
            "a_calls": a_calls,
            "a_ids": a_ids,
            "a_result": a_result,
            "b_calls": b_calls,
            "b_ids": b_ids,
            "b_result": b_result,
        }

    expected, actual = both(models, scenario)
    assert actual["b_calls"][0].tolist()[0][:6] == [0] * 6  # Q's prompt is left-padded to P's 8 tokens
    assert actual["b_result"].shape == (1, 11)
    assert_same(expected, actual)


def test_a_list_invoke_reads_a_row_per_prompt(models):
    def scenario(model):
        with model.generate([P, Q], max_new_tokens=2) as tracer:
            calls = list().save()
            for step in tracer.iter[:3]:
                calls.append(model.generator.streamer.output)
            ids = model.generator.output.save()
        return {"calls": calls, "ids": ids}

    expected, actual = both(models, scenario)
    assert [tuple(t.shape) for t in actual["calls"]] == [(2, 8), (2,), (2,)]
    assert_same(expected, actual)


def test_an_empty_invoke_reads_every_prompt_of_the_trace(models):
    def scenario(model):
        with model.generate(max_new_tokens=2) as tracer:
            with tracer.invoke(P):
                pass
            with tracer.invoke(R):
                pass
            with tracer.invoke():
                prompt = model.generator.streamer.output.save()
                ids = model.generator.output.save()
        return {"prompt": prompt, "ids": ids}

    expected, actual = both(models, scenario)
    assert actual["ids"].shape == (2, 10)
    assert_same(expected, actual)


def test_assigning_generator_output_replaces_the_result(models):
    def scenario(model):
        with model.generate(P, max_new_tokens=2) as tracer:
            model.generator.output = torch.zeros(1, 3, dtype=torch.long)
            result = tracer.result.save()
        return result

    expected, actual = both(models, scenario)
    assert actual.tolist() == [[0, 0, 0]]
    assert_same(expected, actual)


def test_assigning_the_streamer_output_changes_nothing(models):
    def scenario(model):
        with model.generate(P, max_new_tokens=3) as tracer:
            for step in tracer.iter[:4]:
                model.generator.streamer.output = torch.zeros_like(model.generator.streamer.output)
            result = tracer.result.save()
        return result

    expected, actual = both(models, scenario)
    assert_same(expected, actual)


def test_streamer_tokens_are_the_tokens_a_steered_generation_samples(models):
    def scenario(model):
        with model.generate(P, max_new_tokens=3) as tracer:
            tokens = list().save()
            for step in tracer.iter[:3]:  # the streamer's call before each of the 3 forwards
                tokens.append(model.generator.streamer.output)
                model.model.layers[1].output[:] *= 0.25
            result = tracer.result.save()
        return {"tokens": tokens, "result": result}

    expected, actual = both(models, scenario)
    assert_same(expected, actual)
    assert actual["result"][0, 8:10].tolist() == [t.item() for t in actual["tokens"][1:]]


@pytest.mark.parametrize("location", ["generator.output", "generator.streamer.output"])
def test_a_trace_never_reaches_the_generator(models, location):
    """A trace is one forward: as on HF, a block waiting on the generator fails the trace."""

    def scenario(model):
        with pytest.raises(Exception) as raised:
            with model.trace(P):
                envoy = model.generator if location == "generator.output" else model.generator.streamer
                envoy.output.save()
        return type(raised.value).__name__, str(raised.value)

    expected, actual = both(models, scenario)
    assert actual == expected


def test_reading_the_streamer_after_its_step_ran_past_fails_as_on_hf(models):
    """The prompt visit comes before the first forward: reading it after a layer of that forward is too late."""

    def scenario(model):
        with pytest.raises(Exception) as raised:
            with model.generate(P, max_new_tokens=2):
                model.model.layers[0].output.save()
                model.generator.streamer.output.save()
        return type(raised.value).__name__, str(raised.value)

    expected, actual = both(models, scenario)
    assert actual == expected


def test_blocks_of_concurrent_generations_count_only_their_own_streamer_visits(models):
    """Another trace's steps (and prompt) in the same engine steps must not shift a block's occurrences."""
    oracle, ours = models
    with oracle.generate(R, max_new_tokens=6) as tracer:
        expected = list().save()
        for step in tracer.iter[:7]:
            expected.append(oracle.generator.streamer.output)
    results: dict[str, list] = {}

    def run(name: str, prompt: str, n: int) -> None:
        with ours.generate(prompt, max_new_tokens=n) as tracer:
            calls = list().save()
            for step in tracer.iter[: n + 1]:
                calls.append(ours.generator.streamer.output)
        results[name] = calls

    with ours.engine.paused():  # both traces enter the same steps
        threads = [threading.Thread(target=run, args=("r", R, 6)), threading.Thread(target=run, args=("q", Q, 3))]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert_same(expected, results["r"])
    assert [tuple(t.shape) for t in results["q"]] == [(1, 2), (1,), (1,), (1,)]


# ---- HF streamers -------------------------------------------------------------------------
def test_a_plain_generate_calls_a_streamer_as_hf_does(models):
    def scenario(model):
        streamer = Recorder()
        ids = model.generate(P, max_new_tokens=3, streamer=streamer)
        return ids, streamer.calls

    (expected_ids, expected_calls), (ids, calls) = both(models, scenario)
    assert torch.equal(ids, expected_ids)
    assert calls == expected_calls
    assert [c[0] for c in calls] == ["put", "put", "put", "put", "end"]


def test_a_generate_block_calls_a_streamer_as_hf_does(models):
    def scenario(model):
        streamer = Recorder()
        with model.generate(P, max_new_tokens=3, streamer=streamer):
            hidden = model.model.layers[0].output.save()
            ids = model.generator.output.save()
        return ids, hidden, streamer.calls

    (expected_ids, expected_hidden, expected_calls), (ids, hidden, calls) = both(models, scenario)
    assert torch.equal(ids, expected_ids)
    assert_same(expected_hidden, hidden)
    assert calls == expected_calls


def test_a_users_streamer_replaces_nnsights_streamer(models):
    """nnsight hands generate its own streamer only when the caller gives none: then streamer.output never comes."""

    def scenario(model):
        streamer = Recorder()
        with pytest.raises(Exception) as raised:
            with model.generate(P, max_new_tokens=2, streamer=streamer):
                model.generator.streamer.output.save()
        return type(raised.value).__name__, str(raised.value), streamer.calls

    expected, actual = both(models, scenario)
    assert actual == expected


def test_text_streamer_prints_what_hf_prints(models, capsys):
    def scenario(model):
        model.generate(P, max_new_tokens=4, streamer=TextStreamer(model.tokenizer))
        model.generate(P, max_new_tokens=4, streamer=TextStreamer(model.tokenizer, skip_prompt=True))
        return capsys.readouterr().out

    expected, actual = both(models, scenario)
    assert actual == expected
    assert actual.count(P) == 1


def test_text_iterator_streamer_consumed_from_another_thread(models):
    def scenario(model):
        streamer = TextIteratorStreamer(model.tokenizer, timeout=WAIT_S)
        generation = threading.Thread(
            target=model.generate, args=(P,), kwargs={"max_new_tokens": 5, "streamer": streamer}
        )
        generation.start()
        pieces = list(streamer)  # raises queue.Empty after WAIT_S without a piece
        generation.join(WAIT_S)
        assert not generation.is_alive()
        return pieces

    expected, actual = both(models, scenario)
    assert actual == expected
    assert "".join(actual).strip()


def test_several_prompts_with_a_text_streamer_are_refused_as_hf_refuses_them(models):
    def scenario(model):
        with pytest.raises(ValueError) as raised:
            model.generate([P, Q], max_new_tokens=2, streamer=TextStreamer(model.tokenizer))
        return str(raised.value)

    expected, actual = both(models, scenario)
    assert actual == expected == "TextStreamer only supports batch size 1"


def test_a_batch_streamer_gets_hfs_padded_batches(models):
    def scenario(model):
        plain = Recorder()
        model.generate([P, Q], max_new_tokens=2, streamer=plain)
        traced = Recorder()
        with model.generate(max_new_tokens=2, streamer=traced) as tracer:
            with tracer.invoke(Q):
                pass
            with tracer.invoke(R):
                pass
        return plain.calls, traced.calls

    expected, actual = both(models, scenario)
    assert actual == expected
    assert actual[0][0][1] == (2, 8)


def test_tokens_reach_the_streamer_while_the_generation_runs(models):
    """The block waits (on the engine thread) in step 3 until the streamer has had step 1's token."""
    _, ours = models
    seen_token = threading.Event()

    class SignalOnSecondToken(Recorder):
        def put(self, value: torch.Tensor) -> None:
            super().put(value)
            if len(self.calls) == 3:  # the prompt, then the tokens of steps 0 and 1
                seen_token.set()

    streamer = SignalOnSecondToken()
    with ours.generate(P, max_new_tokens=5, streamer=streamer) as tracer:
        waited = list().save()
        for step in tracer.iter[:5]:
            if step == 3:
                waited.append(seen_token.wait(WAIT_S))
            ours.model.layers[0].output.save()
    assert waited == [True]
    assert len(streamer.calls) == 7


def test_a_streamer_that_stalls_does_not_stall_the_engine(models):
    """put() runs on the caller's thread: another generation completes while a streamer is stuck."""
    oracle, ours = models
    release = threading.Event()

    class Stuck(Recorder):
        def put(self, value: torch.Tensor) -> None:
            super().put(value)
            if len(self.calls) == 2:
                release.wait(WAIT_S)

    stuck = Stuck()
    generation = threading.Thread(target=ours.generate, args=(P,), kwargs={"max_new_tokens": 4, "streamer": stuck})
    generation.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while len(stuck.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(stuck.calls) == 2
        other = ours.generate(R, max_new_tokens=4)  # bounded by the engine, not by the stuck streamer
        assert torch.equal(other, oracle.generate(R, max_new_tokens=4))
        assert not release.is_set() and len(stuck.calls) == 2
    finally:
        release.set()
        generation.join(WAIT_S)
    assert not generation.is_alive()
    assert [c[0] for c in stuck.calls] == ["put"] * 5 + ["end"]


class Failing(Recorder):
    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        if len(self.calls) == 2:
            raise RuntimeError("the display broke")


def test_an_error_in_put_fails_that_generation_only(models):
    oracle, ours = models
    with pytest.raises(RuntimeError, match="the display broke"):
        ours.generate(P, max_new_tokens=3, streamer=Failing())
    with pytest.raises(RuntimeError, match="the display broke"):
        with ours.generate(P, max_new_tokens=3, streamer=Failing()):
            ours.model.layers[0].output.save()
    deadline = time.monotonic() + WAIT_S
    while ours.engine.num_requests_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ours.engine.num_requests_in_flight == 0  # the failed generations' requests were ended
    assert torch.equal(ours.generate(R, max_new_tokens=3), oracle.generate(R, max_new_tokens=3))


def test_a_stopped_generation_ends_its_streamer_as_hf_does(models):
    def scenario(model):
        streamer = Recorder()
        with model.generate(P, max_new_tokens=3, streamer=streamer) as tracer:
            model.model.layers[0].output.save()
            tracer.stop()
        return streamer.calls

    expected, actual = both(models, scenario)
    assert actual == expected  # the prompt only: no token, no end()


def test_a_streamer_without_put_and_end_is_refused(models):
    _, ours = models
    with pytest.raises(TypeError, match="streamer must have put"):
        ours.generate(P, max_new_tokens=1, streamer=object())


# ---- generation keywords on trace -------------------------------------------------------------
GENERATION_KEYWORDS = [
    {"max_new_tokens": 3},
    {"do_sample": True, "temperature": 0.5, "top_k": 3, "top_p": 0.9},
    {"min_new_tokens": 2, "max_length": 20, "repetition_penalty": 1.3, "seed": 1},
]


@pytest.mark.parametrize("kwargs", GENERATION_KEYWORDS)
def test_trace_takes_generation_keywords_and_runs_one_forward(models, kwargs):
    """HF's forward takes generate's keywords and ignores them: a trace is still one forward."""

    def scenario(model):
        with model.trace(P, **kwargs) as tracer:
            logits = model.lm_head.output.save()
            result = tracer.result.save()
        with model.trace() as tracer:
            with tracer.invoke(Q, **kwargs):
                invoked = model.lm_head.output.save()
        return {"logits": logits, "result": result, "invoked": invoked}

    expected, actual = both(models, scenario)
    assert actual["logits"].shape == (1, 8, 128)
    assert_same(expected, actual)


def test_trace_never_calls_a_streamer(models):
    def scenario(model):
        streamer = Recorder()
        with model.trace(P, streamer=streamer):
            logits = model.lm_head.output.save()
        return logits, streamer.calls

    (expected_logits, expected_calls), (logits, calls) = both(models, scenario)
    assert calls == expected_calls == []
    assert_same(expected_logits, logits)


def test_trace_still_refuses_keywords_that_are_not_generation_settings(models):
    _, ours = models
    with pytest.raises(TypeError, match="unsupported keyword.*max_new_token"):
        ours.trace(P, max_new_token=3)  # a typo


# ---- prompts that end at different steps (EOS) ------------------------------------------------
SHORT, LONG = "The capital of France is", "Two plus two is"  # tiny-facts-gpt2 ends them after 3 and 7 tokens


@pytest.fixture(scope="module")
def facts():
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import nnsight

    import nnrun

    path = nnrun.bundled_model_path("tiny-facts-gpt2")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = nnsight.LanguageModel(copy.deepcopy(model), tokenizer=AutoTokenizer.from_pretrained(path))
        ours = nnrun.LanguageModel(model, tokenizer=AutoTokenizer.from_pretrained(path))
        yield oracle, ours
    ours.shutdown()


def test_a_streamer_gets_pad_tokens_for_a_finished_prompt_as_on_hf(facts):
    def scenario(model):
        streamer = Recorder()
        ids = model.generate([SHORT, LONG], max_new_tokens=12, streamer=streamer)
        return ids, streamer.calls

    (expected_ids, expected_calls), (ids, calls) = both(facts, scenario)
    assert torch.equal(ids, expected_ids)
    assert calls == expected_calls
    assert len(calls) == 1 + 7 + 1  # the prompts, 7 steps (the short one padded after its EOS), end()


def test_generator_values_of_prompts_that_finish_apart_are_hfs(facts):
    def scenario(model):
        with model.generate(max_new_tokens=12) as tracer:
            with tracer.invoke([SHORT, LONG]):
                calls = list().save()
                for step in tracer.iter[:8]:
                    calls.append(model.generator.streamer.output)
                both_ids = model.generator.output.save()
            with tracer.invoke(SHORT):
                short_ids = tracer.result.save()
        return {"calls": calls, "both_ids": both_ids, "short_ids": short_ids}

    expected, actual = both(facts, scenario)
    assert actual["short_ids"].shape == (1, actual["both_ids"].shape[1])  # padded to the whole batch's width
    assert_same(expected, actual)
