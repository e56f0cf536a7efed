"""NNsightRequestHelper: groups per step, starting, finishing and saves, driven by hand (no engine)."""

from __future__ import annotations

import threading

import torch

from interleaver.batcher import PackedBatcher
from interleaver.jobs import Invocation, TraceJob
from interleaver.mediator import PackedInterleaver, PackedMediator
from interleaver.requests import NNsightRequestHelper
from nnrun.forward_batch import ForwardBatch, ForwardMode
from nnrun.request import Request, RequestStatus
from nnrun.sampling_params import SamplingParams

LOCATION = "model.model.layers.0.output"
BLOCK = compile(
    f"from nnsight.intervention.interleaver import Mediator\nseen = Mediator.value({LOCATION!r}).clone().save()\n",
    "<block>",
    "exec",
)


def mediator() -> PackedMediator:
    return PackedMediator(BLOCK, {}, {})


def request(request_id: str, num_tokens: int, job: TraceJob) -> Request:
    req = Request(request_id, list(range(num_tokens)), SamplingParams(max_tokens=1), extra_args={"nnsight": job})
    job.requests[request_id] = req
    return req


def forward_batch(reqs: list[Request]) -> ForwardBatch:
    lengths = [r.num_tokens for r in reqs]
    starts = [sum(lengths[:i]) for i in range(len(reqs))]
    ends = [s + n - 1 for s, n in zip(starts, lengths)]
    return ForwardBatch(
        ForwardMode.EXTEND,
        reqs,
        torch.zeros(sum(lengths), dtype=torch.int64),
        torch.zeros(sum(lengths), dtype=torch.int64),
        torch.zeros(sum(lengths), dtype=torch.int64),
        lengths,
        starts,
        [0] * len(reqs),
        [],
        torch.tensor(ends),
        list(range(len(reqs))),
    )


def on_engine_thread(fn):
    """Workers run on the thread that serves them; keep this test's trace depth off pytest's thread."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_groups_follow_the_batch_and_invocations_serve_in_trace_then_invoke_order():
    first = TraceJob("trace", [Invocation(mediator(), ["a0"], 0), Invocation(mediator(), ["a1", "a2"], 1)], seq=1)
    second = TraceJob("trace", [Invocation(mediator(), ["b0"], 0)], seq=0)
    reqs = [request("b0", 2, second), request("a1", 3, first), request("a0", 4, first), request("a2", 1, first)]
    helper = NNsightRequestHelper(PackedInterleaver(PackedBatcher(None)))
    helper.process_new_reqs(reqs)
    batch = forward_batch(reqs)
    order = helper.process_batch_groups(batch, [(row, 1) for row in range(4)])
    assert [inv.request_ids for inv in order] == [["b0"], ["a0"], ["a1", "a2"]]
    listed = first.invocations[1].mediator.batch_group  # members in invoke order, wherever the batch put them
    assert listed.token_spans == [(2, 3), (9, 1)] and listed.rows == [1, 3]
    assert first.invocations[0].mediator.batch_group.token_spans == [(5, 4)]


def test_a_step_serves_each_block_its_tokens_and_finishing_returns_the_saves():
    def drive():
        job = TraceJob("trace", [Invocation(mediator(), ["x"], 0), Invocation(mediator(), ["y", "x"], 1)])
        reqs = [request("x", 3, job), request("y", 2, job)]
        interleaver = PackedInterleaver(PackedBatcher(None))
        helper = NNsightRequestHelper(interleaver)
        helper.process_new_reqs(reqs)
        batch = forward_batch(reqs)
        invocations = helper.process_batch_groups(batch, [(0, 1), (1, 1)])
        interleaver.batcher.set_step(5, 2, 2)
        helper.start(invocations)
        assert all(inv.mediator.pending.provider == LOCATION for inv in invocations)
        hidden = torch.arange(5.0).reshape(1, 5, 1).expand(1, 5, 2).contiguous()  # [1, N, H]
        interleaver.handle(LOCATION, hidden)
        reqs[0].status = RequestStatus.FINISHED
        assert helper.process_finished_reqs([reqs[0]]) == [job.invocations[0]]  # "y" still runs
        helper.finish([job.invocations[0]])
        assert not job.done.is_set()
        reqs[1].status = RequestStatus.FINISHED
        helper.finish(helper.process_finished_reqs([reqs[1]]))
        assert job.done.is_set() and not helper.live and not helper.request_to_invocations
        return [inv.saves["seen"] for inv in job.invocations]

    alone, pair = on_engine_thread(drive)
    assert alone.tolist() == [[[0, 0], [1, 1], [2, 2]]]
    assert pair.shape == (2, 3, 2) and pair[0, 1:].tolist() == [[3, 3], [4, 4]]
    assert pair[1].tolist() == alone[0].tolist()


def test_a_request_that_fails_before_any_step_still_finishes_its_trace():
    job = TraceJob("trace", [Invocation(mediator(), ["z"], 0)])
    req = request("z", 3, job)
    req.status = RequestStatus.FINISHED
    req.error = RuntimeError("KV pool exhausted")
    helper = NNsightRequestHelper(PackedInterleaver(PackedBatcher(None)))
    helper.finish(helper.process_finished_reqs([req]))
    assert job.done.is_set() and job.error is req.error
