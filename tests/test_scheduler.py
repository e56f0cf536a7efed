"""Scheduler decisions on plain requests, without a model (milliseconds)."""

from nnrun.config import SchedulerConfig
from nnrun.forward_batch import ForwardMode
from nnrun.memory import ReqToTokenPool, TokenToKVPoolAllocator
from nnrun.request import Request, RequestStatus
from nnrun.sampling_params import SamplingParams
from nnrun.scheduler import Scheduler
from nnrun.stop import StopChecker


def make_scheduler(num_pages=16, page_size=4, max_num_seqs=4, max_num_batched_tokens=64):
    allocator = TokenToKVPoolAllocator(num_pages, page_size)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, allocator, ReqToTokenPool(max_num_seqs + 1, 256), StopChecker({0}, 256, None))


def make_req(n, order, max_tokens=8, preemptible=True):
    return Request(
        f"r{order}",
        list(range(1, n + 1)),
        SamplingParams(max_tokens=max_tokens),
        arrival_order=order,
        is_preemptible=preemptible,
    )


def run_step(scheduler, batch, token=5):
    return scheduler.process_batch_result(batch.reqs, [token] * len(batch.reqs), [None] * len(batch.reqs))


def test_prefill_then_decode_modes_and_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=20)
    for i, n in enumerate([10, 8, 6]):
        scheduler.add_request(make_req(n, i))
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.reqs] == ["r0", "r1"] and batch.forward_mode is ForwardMode.EXTEND
    run_step(scheduler, batch)
    batch = scheduler.schedule()  # two decodes and the third prefill share a step
    assert [r.request_id for r in batch.reqs] == ["r0", "r1", "r2"] and batch.forward_mode is ForwardMode.EXTEND
    run_step(scheduler, batch)
    assert scheduler.schedule().forward_mode is ForwardMode.DECODE


def test_a_prompt_longer_than_the_budget_runs_alone():
    scheduler = make_scheduler(num_pages=64, max_num_batched_tokens=8)
    scheduler.add_request(make_req(30, 0))
    scheduler.add_request(make_req(3, 1))
    assert [r.request_id for r in scheduler.schedule().reqs] == ["r0"]


def test_max_num_seqs_limits_running():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(make_req(2, i))
    assert len(scheduler.schedule().reqs) == 2 and len(scheduler.waiting) == 2


def test_preempts_the_newest_and_recomputes_it_later():
    scheduler = make_scheduler(num_pages=4, page_size=4)  # 16 slots
    old, new = make_req(8, 0), make_req(8, 1)
    scheduler.add_request(old)
    scheduler.add_request(new)
    run_step(scheduler, scheduler.schedule())  # 8 cached tokens each in 2 pages: the pool is full
    batch = scheduler.schedule()  # old needs a third page: new is preempted
    assert batch.reqs == [old] and new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1 and new.page_ids == [] and new.output_token_ids == [5]


def test_unpreemptible_requests_are_never_preempted():
    scheduler = make_scheduler(num_pages=4, page_size=4)
    old, pinned = make_req(8, 0), make_req(8, 1, preemptible=False)
    scheduler.add_request(old)
    scheduler.add_request(pinned)
    run_step(scheduler, scheduler.schedule())
    batch = scheduler.schedule()
    assert batch.reqs == [pinned] and old.status is RequestStatus.WAITING


def test_finish_frees_everything():
    scheduler = make_scheduler()
    req = make_req(5, 0, max_tokens=2)
    scheduler.add_request(req)
    run_step(scheduler, scheduler.schedule())
    finished = run_step(scheduler, scheduler.schedule())
    assert finished == [req] and req.finish_reason.value == "length"
    scheduler.allocator.check_no_leaks()
    assert not scheduler.has_unfinished


def test_eos_stops_unless_ignored():
    scheduler = make_scheduler()
    stops, ignores = make_req(3, 0), make_req(3, 1)
    ignores.sampling_params = SamplingParams(max_tokens=8, ignore_eos=True)
    scheduler.add_request(stops)
    scheduler.add_request(ignores)
    finished = run_step(scheduler, scheduler.schedule(), token=0)
    assert finished == [stops] and stops.finish_reason.value == "stop" and not ignores.is_finished


def test_failed_request_finishes_with_error_and_others_go_on():
    scheduler = make_scheduler()
    bad, good = make_req(3, 0), make_req(3, 1)
    scheduler.add_request(bad)
    scheduler.add_request(good)
    batch = scheduler.schedule()
    bad.fail(ValueError("boom"))
    finished = run_step(scheduler, batch)
    assert finished == [bad] and bad.finish_reason.value == "error" and bad.page_ids == []
    assert scheduler.schedule().reqs == [good]
