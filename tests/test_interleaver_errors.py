"""Errors in intervention code reach the trace that wrote them, and leave nothing behind."""

from __future__ import annotations

import threading
import traceback
import warnings

import pytest
import torch

from conformance import jobs
from conformance.compare import assert_same
from conformance.models import tiny_llama, tiny_tokenizer

PROMPT = "the eiffel tower is in the city of"  # 8 tokens


@pytest.fixture(scope="module")
def model():
    import nnrun

    lm = nnrun.LanguageModel(tiny_llama(seed=5), tokenizer=tiny_tokenizer())
    yield lm
    lm.shutdown()


def _lines_of(error: BaseException) -> list[tuple[str, int]]:
    return [(frame.filename, frame.lineno) for frame in traceback.extract_tb(error.__traceback__)]


def _line_of(fn, text: str) -> int:
    import inspect

    source, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(source) if text in line)


def failing_trace(model):
    with model.generate(PROMPT, max_new_tokens=4) as tracer:
        for step in tracer.iter[:4]:
            hidden = model.model.layers[0].output
            if step == 2:
                hidden @ torch.zeros(3, 3)  # the user's bad line
    return None


def assert_nothing_left(model) -> None:
    runner = model.engine.runner
    helper = runner.nnsight_requests
    assert not helper.live and not helper.request_to_invocations and not helper.step_invocations
    assert runner.interleaver.mediators == []
    assert not runner.interleaver.interleaving
    runner.allocator.check_no_leaks()
    assert runner.req_to_token_pool.num_free_rows == runner.req_to_token_pool.req_to_token.shape[0]
    for module in model.engine.model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
    assert not model.engine.core.has_unfinished


def test_error_is_raised_in_its_trace_with_the_user_line_while_others_complete(model):
    good = [(jobs.steer, jobs.prompt(11, 5)), (jobs.per_step, jobs.prompt(12, 9)), (jobs.read, jobs.prompt(13, 4))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = [job(model, text) for job, text in good]
    results: dict[int, dict] = {}
    failures: list[BaseException] = []
    start = threading.Barrier(len(good) + 1)

    def run_good(i):
        start.wait()
        job, text = good[i]
        results[i] = job(model, text)

    def run_bad():
        start.wait()
        try:
            failing_trace(model)
        except RuntimeError as error:
            failures.append(error)

    threads = [threading.Thread(target=run_good, args=(i,)) for i in range(len(good))]
    threads.append(threading.Thread(target=run_bad))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert len(failures) == 1, "the failing trace did not raise"
    assert (__file__, _line_of(failing_trace, "the user's bad line")) in _lines_of(failures[0])
    for i in range(len(good)):
        assert_same(alone[i], results[i], f"good trace {i}")
    assert_nothing_left(model)


def test_other_invokes_of_the_failing_trace_keep_their_saves(model):
    with pytest.raises(ZeroDivisionError):
        with model.trace() as tracer:
            with tracer.invoke(PROMPT):
                kept = model.model.layers[1].output.save()
            with tracer.invoke("big ben is in"):
                model.model.layers[0].output
                1 / 0
    assert kept.shape == (1, 8, 64)
    assert_nothing_left(model)


def test_wrong_module_path_names_the_path_and_the_nearest_names(model):
    with pytest.raises(AttributeError) as caught:
        with model.trace(PROMPT):
            model.model.layerz[0].output.save()
    message = str(caught.value)
    assert "model.model.layerz" in message and "'layers'" in message
    with pytest.raises(AttributeError, match="model.model.layers.0.mpl.*'mlp'"):
        model.model.layers[0].mpl
    assert_nothing_left(model)


def test_wrong_shape_write_names_the_module_and_both_shapes(model):
    def write_wrong_shape():
        with model.trace(PROMPT):
            model.model.layers[1].output = torch.zeros(1, 3, 64)  # the wrong-shape line
            model.lm_head.output.save()

    with pytest.raises(ValueError) as caught:
        write_wrong_shape()
    message = str(caught.value)
    assert "model.model.layers.1" in message and "(1, 3, 64)" in message and "(1, 8, 64)" in message
    assert (__file__, _line_of(write_wrong_shape, "the wrong-shape line")) in _lines_of(caught.value)
    assert_nothing_left(model)


def test_error_before_the_first_read_and_out_of_order_reads(model):
    with pytest.raises(KeyError):
        with model.trace(PROMPT):
            {}["missing"]
    with pytest.raises(Exception, match="model.model.layers.0.output"):
        with model.trace(PROMPT):
            model.model.layers[1].output.save()
            model.model.layers[0].output.save()
    assert_nothing_left(model)


def test_engine_keeps_serving_after_errors(model):
    with pytest.raises(RuntimeError):
        failing_trace(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert jobs.read(model, PROMPT)["h"].shape == (1, 8, 64)
    assert_nothing_left(model)
