"""Traces from many threads share the engine's steps, and each sees only its own requests."""

from __future__ import annotations

import threading
import warnings

import pytest

from conformance import jobs
from conformance.compare import assert_same
from conformance.models import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def model():
    import nnrun

    lm = nnrun.LanguageModel(tiny_llama(seed=3), tokenizer=tiny_tokenizer())
    yield lm
    lm.shutdown()


def _spy_steps(monkeypatch, runner) -> list[int]:
    """How many distinct traces each engine step carried."""
    traces_per_step: list[int] = []
    forward = runner.forward

    def spy(forward_batch):
        jobs_in_step = {id(r.extra_args["nnsight"]) for r in forward_batch.reqs if "nnsight" in r.extra_args}
        traces_per_step.append(len(jobs_in_step))
        return forward(forward_batch)

    monkeypatch.setattr(runner, "forward", spy)
    return traces_per_step


def test_sixteen_traces_from_eight_threads_equal_running_alone(model, monkeypatch):
    specs = [(jobs.KINDS[i % len(jobs.KINDS)], jobs.prompt(seed=i, length=3 + (5 * i) % 9)) for i in range(16)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = [job(model, text) for job, text in specs]
    traces_per_step = _spy_steps(monkeypatch, model.engine.runner)
    together: dict[int, dict] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def client(thread: int) -> None:
        try:
            start.wait()
            for index in (thread, thread + 8):
                job, text = specs[index]
                together[index] = job(model, text)
        except BaseException as error:  # surfaced by the main thread
            errors.append(error)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert not errors, errors
    assert sorted(together) == list(range(16))
    for index in range(16):
        assert_same(alone[index], together[index], f"trace {index} ({specs[index][0].__name__})")
    assert max(traces_per_step) >= 3, f"traces never shared a step: {traces_per_step}"
    runner = model.engine.runner
    assert not runner.nnsight_requests.live and not runner.nnsight_requests.request_to_invocations


def test_plain_engine_requests_share_steps_with_traces(model):
    from nnrun import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0)
    texts = [jobs.prompt(seed=40 + i, length=4 + i) for i in range(4)]
    plain_alone = [out.outputs[0].token_ids for out in model.engine.generate(texts, params)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced_alone = jobs.steer(model, texts[0])
    outputs = {}
    thread = threading.Thread(target=lambda: outputs.update(plain=model.engine.generate(texts, params)))
    thread.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = jobs.steer(model, texts[0])
    thread.join(60)
    assert [out.outputs[0].token_ids for out in outputs["plain"]] == plain_alone
    assert_same(traced_alone, traced)
