"""One trace can never change, fail or hang another (issue 12, items 1 to 5).

Each test co-schedules a hostile trace with innocent requests (plain generations and traces) in
the same engine steps, then checks that the innocents are exactly what they are alone, that the
hostile caller gets a clear error of the right type, and that nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import pytest
import torch
from chaos_helpers import WAIT_S, co_scheduled

import nnrun
from interleaver.batcher import InvalidWriteError
from nnrun.engine_core import StepFailedError
from tolerance import assert_close_packed

INNOCENT_PROMPTS = ["The Colosseum is in", "The Eiffel Tower is in", "Paris"]  # mixed lengths: decode padding


class CustomStop(BaseException):
    """A user's own BaseException."""


def innocents(tiny_facts) -> list:
    """Plain generations (checked against their solo tokens) and a reading trace (its saved output)."""
    engine = tiny_facts.model.engine
    return [lambda p=p: engine.generate([p], tiny_facts.params)[0].outputs[0].token_ids for p in INNOCENT_PROMPTS]


def run_innocents_now(tiny_facts) -> list:
    """The innocents again, after the hostile trace: bounded, so a stuck engine fails instead of hanging."""
    handles = [tiny_facts.model.engine.submit(p, tiny_facts.params) for p in INNOCENT_PROMPTS]
    return [handle.result(timeout=WAIT_S).outputs[0].token_ids for handle in handles]


def check_innocents(tiny_facts, results: list) -> None:
    assert results == [tiny_facts.solo(p) for p in INNOCENT_PROMPTS]


def hostile_generate(model, body, max_new_tokens: int = 6):
    def run():
        with model.generate("The Louvre is in", max_new_tokens=max_new_tokens) as tracer:
            body(model, tracer)

    return run


# ---- 1. NaN and inf ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_written_every_step_stay_in_the_request_that_wrote_them(tiny_facts, clean_after, value):
    def body(model, tracer):
        for _ in tracer.all():
            model.model.layers[1].output[:] = value

    *results, hostile = co_scheduled(
        tiny_facts.model.engine, innocents(tiny_facts) + [hostile_generate(tiny_facts.model, body)], 4
    )
    check_innocents(tiny_facts, results)
    assert hostile is None  # its own rows are NaN, and greedy argmax takes a NaN row as HF does: no error


# ---- 2. bad writes to samples, logits and activations ----------------------------------------------
@pytest.mark.parametrize(
    "write, match",
    [
        (lambda m: m.samples.__setitem__(slice(None), 5000), "token id 5000 is outside the vocabulary"),
        (lambda m: m.samples.__setitem__(slice(None), -1), "token id -1 is outside the vocabulary"),
        (lambda m: setattr(m, "samples", torch.tensor([5000])), "token id 5000 is outside the vocabulary"),
        (lambda m: setattr(m, "samples", torch.tensor([2.5])), "token ids must be integers"),
        (lambda m: setattr(m, "logits", torch.full((1, 768), float("nan"))), "logits containing NaN"),
        (lambda m: setattr(m, "logits", torch.zeros(1, 5)), "shape"),
    ],
)
def test_a_bad_write_to_samples_or_logits_fails_only_its_request(tiny_facts, clean_after, write, match):
    def body(model, tracer):
        for _ in tracer.all():
            write(model)

    *results, hostile = co_scheduled(
        tiny_facts.model.engine, innocents(tiny_facts) + [hostile_generate(tiny_facts.model, body)], 4
    )
    check_innocents(tiny_facts, results)
    assert isinstance(hostile, InvalidWriteError) and match in str(hostile)


def test_nan_logits_under_sampling_fail_only_their_request(tiny_facts, clean_after):
    model = tiny_facts.model

    def hostile():
        with model.generate("The Louvre is in", max_new_tokens=4, do_sample=True, temperature=1.0) as tracer:
            for _ in tracer.all():
                model.lm_head.output[:] = float("nan")

    *results, error = co_scheduled(model.engine, innocents(tiny_facts) + [hostile], 4)
    check_innocents(tiny_facts, results)
    assert isinstance(error, ValueError) and "no token can be sampled" in str(error)


@pytest.mark.parametrize(
    "value, match",
    [
        ("hello", "cannot assign str"),
        (None, "cannot assign NoneType"),
        (torch.zeros(1, 5, 192, device="meta"), "meta tensor"),
        (torch.zeros(3, 3), "shape"),
    ],
)
def test_a_bad_activation_write_raises_at_the_users_line(tiny_facts, clean_after, value, match):
    model = tiny_facts.model

    def hostile():
        with model.trace("Paris is in"):
            model.model.layers[0].output = value  # the line the traceback must end at

    *results, error = co_scheduled(model.engine, innocents(tiny_facts) + [hostile], 4)
    check_innocents(tiny_facts, results)
    assert isinstance(error, InvalidWriteError) and match in str(error)
    last = traceback.extract_tb(error.__traceback__)[-1]
    assert last.line == "model.model.layers[0].output = value  # the line the traceback must end at"


def test_a_step_that_fails_after_an_edit_ends_only_the_editor_and_runs_again(tiny_facts, clean_after):
    """Out-of-vocabulary ids swapped into the embedding pass every shape check but fail the forward."""
    model = tiny_facts.model
    with model.trace("The Louvre is in"):
        alone = model.model.layers[1].output.save()

    def hostile():
        with model.trace("Paris is in"):
            ids = model.model.embed_tokens.input
            model.model.embed_tokens.input = torch.full_like(ids, 10**6)

    def reader():
        with model.trace("The Louvre is in"):
            hidden = model.model.layers[1].output.save()
        return hidden

    *results, hidden, error = co_scheduled(model.engine, innocents(tiny_facts) + [reader, hostile], 5)
    check_innocents(tiny_facts, results)
    assert_close_packed(hidden, alone)  # packed with others: float summation order only
    assert isinstance(error, StepFailedError) and "IndexError" in str(error)


# ---- 3. BaseException in a block -----------------------------------------------------------------
@pytest.mark.parametrize(
    "raised", [KeyboardInterrupt(), SystemExit(3), CustomStop("halt"), pytest.fail.Exception("failed inside a block")]
)
def test_a_base_exception_in_a_block_reaches_its_caller_and_the_engine_serves_on(tiny_facts, clean_after, raised):
    model = tiny_facts.model

    def hostile():
        with model.trace("Paris is in"):
            model.model.layers[0].output.save()
            raise raised

    *results, error = co_scheduled(model.engine, innocents(tiny_facts) + [hostile], 4)
    check_innocents(tiny_facts, results)
    assert error is raised
    check_innocents(tiny_facts, run_innocents_now(tiny_facts))  # and later requests too


def press_ctrl_c_once_running(engine: nnrun.LLM, delay_s: float) -> threading.Thread:
    """Send SIGINT (Ctrl-C: KeyboardInterrupt in the main thread, the test's) once a request is in flight."""
    assert threading.current_thread() is threading.main_thread()

    def interrupt() -> None:
        deadline = time.monotonic() + 30
        while engine.num_requests_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay_s)
        os.kill(os.getpid(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt, daemon=True)
    interrupter.start()
    return interrupter


def test_ctrl_c_while_waiting_on_a_trace_aborts_it_and_keeps_the_engine(tiny_facts, clean_after):
    model = tiny_facts.model
    interrupter = press_ctrl_c_once_running(model.engine, delay_s=0.2)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with model.generate("The Louvre is in", max_new_tokens=100, min_new_tokens=100) as tracer:
            for _ in tracer.all():  # a slow block: about 5 s in all
                model.model.layers[1].output.save()
                time.sleep(0.05)
    interrupter.join(WAIT_S)
    assert time.monotonic() - started < 4, "the interrupt did not stop the wait promptly"
    check_innocents(tiny_facts, run_innocents_now(tiny_facts))


# ---- 4. nested traces and engine calls -----------------------------------------------------------
def nested_trace(model):
    with model.trace("Paris"):
        model.model.layers[0].output.save()


@pytest.mark.parametrize(
    "nested",
    [
        nested_trace,
        lambda model: model.generate("Paris", max_new_tokens=2),
        lambda model: model.engine.generate(["Paris"]),
        lambda model: model.engine.submit("Paris"),
        lambda model: model.engine.shutdown(),
    ],
)
def test_a_nested_engine_call_in_a_block_raises_instead_of_deadlocking(tiny_facts, clean_after, nested):
    model = tiny_facts.model

    def hostile():
        with model.trace("Paris is in"):
            model.model.layers[0].output.save()
            nested(model)

    *results, error = co_scheduled(model.engine, innocents(tiny_facts) + [hostile], 4)
    check_innocents(tiny_facts, results)
    assert isinstance(error, RuntimeError) and "engine thread" in str(error)


# ---- 5. traces larger than a step ----------------------------------------------------------------
def test_a_trace_over_more_prompts_than_a_step_holds_is_refused_not_truncated(tiny_facts, clean_after):
    model = tiny_facts.model
    limit = model.engine.config.scheduler.max_num_seqs
    with pytest.raises(ValueError, match=f"max_num_seqs={limit}"):
        with model.trace(["Paris is in"] * (limit + 1)):
            model.model.layers[0].output.save()
    with model.trace(["Paris is in"] * 40):
        hidden = model.model.layers[0].output.save()
    assert hidden.shape[0] == 40  # every prompt, not a prefix of them


def test_a_trace_larger_than_the_kv_pool_is_refused():
    model = nnrun.LanguageModel("tiny-facts", page_size=4, max_total_tokens=64)
    try:
        with pytest.raises(ValueError, match="KV pool holds 64"):
            with model.trace(["The Eiffel Tower is in"] * 10):
                model.model.layers[0].output.save()
        with model.trace(["The Eiffel Tower is in"] * 3):
            hidden = model.model.layers[0].output.save()
        assert hidden.shape[0] == 3
    finally:
        model.shutdown()


# ---- all of it at once -----------------------------------------------------------------------------
HOSTILE_BODIES = [
    lambda model: model.model.layers[1].output.__setitem__(slice(None), float("nan")),
    lambda model: model.samples.__setitem__(slice(None), 10**6),
    lambda model: setattr(model.model.layers[0], "output", "not a tensor"),
    lambda model: (_ for _ in ()).throw(KeyboardInterrupt()),
    lambda model: model.engine.generate(["Paris"]),
    lambda model: setattr(model.model.embed_tokens, "input", torch.full((1, 5), 10**6)),
]


def test_rounds_of_mixed_hostile_traces_leave_innocents_exact(tiny_facts, clean_after):
    """Every hostile behaviour at once, in the same steps as innocent generations, for a few rounds."""
    model = tiny_facts.model

    def hostile(body):
        def run():
            with model.generate("The Louvre is in", max_new_tokens=4) as tracer:
                for _ in tracer.all():
                    body(model)

        return run

    for _ in range(3):  # bounded: three rounds of six hostile traces beside three innocents
        results = co_scheduled(model.engine, innocents(tiny_facts) + [hostile(b) for b in HOSTILE_BODIES], 9)
        check_innocents(tiny_facts, results[:3])
        assert all(isinstance(error, BaseException) for error in results[4:])  # all but the NaN writer fail
        assert isinstance(results[6], KeyboardInterrupt)


def test_ctrl_c_on_a_trace_whose_block_loops_forever_frees_the_engine(tiny_facts, clean_after):
    """The block holds the engine thread; Ctrl-C must stop the block itself, not only the wait."""
    model = tiny_facts.model
    interrupter = press_ctrl_c_once_running(model.engine, delay_s=0.3)
    with pytest.raises(KeyboardInterrupt):
        with model.trace("The Louvre is in"):
            hidden = model.model.layers[1].output
            while True:  # a user's bug: the block never returns
                hidden = hidden + 0
    interrupter.join(WAIT_S)
    check_innocents(tiny_facts, run_innocents_now(tiny_facts))
