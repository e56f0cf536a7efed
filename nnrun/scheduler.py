"""Scheduler: which requests run in the next step, within the token, sequence and KV budgets."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nnrun.config import SchedulerConfig
from nnrun.forward_batch import ForwardMode
from nnrun.memory import ReqToTokenPool, TokenToKVPoolAllocator, hold_kv, release_kv
from nnrun.request import FinishReason, Request, RequestStatus
from nnrun.stop import StopChecker


@dataclass
class ScheduledBatch:
    reqs: list[Request]
    forward_mode: ForwardMode


class Scheduler:
    """Continuous batching: running requests decode, waiting ones are admitted when budgets allow.

    Every request's uncached tokens run in one step (no chunked prefill), so a traced request sees
    each prompt token in exactly one forward. When the KV pool runs dry the newest preemptible
    request is preempted: its KV is freed and it is recomputed from its tokens later.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: TokenToKVPoolAllocator,
        req_to_token_pool: ReqToTokenPool,
        stop_checker: StopChecker,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.stop_checker = stop_checker
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_schedules = 0  # scheduling decisions made (a multi-step window runs several forwards per one)
        self.just_failed: list[Request] = []  # finished by the scheduler itself; the engine drains this

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    # ---- choosing a step ------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        self.num_schedules += 1
        scheduled, is_decode = self._schedule_running()
        num_running = len(scheduled)
        self._admit_waiting(scheduled, self.config.max_num_batched_tokens - num_running)
        if not scheduled:
            if self.running:  # only unpreemptible requests hold the pool and none can grow: fail the newest
                stuck = max(self.running, key=lambda r: r.arrival_order)
                stuck.fail(
                    RuntimeError(
                        f"KV pool exhausted: request {stuck.request_id} cannot grow and no running request may be "
                        "preempted; give the engine a larger pool (max_total_tokens / num_pages)"
                    )
                )
                self._finish(stuck, FinishReason.ERROR, stuck.error)
                self.just_failed.append(stuck)
            return None
        is_decode = is_decode and len(scheduled) == num_running  # an admitted request brings its prompt
        return ScheduledBatch(scheduled, ForwardMode.DECODE if is_decode else ForwardMode.EXTEND)

    def _admit_waiting(self, scheduled: list[Request], budget: int) -> None:
        """Admit waiting requests in order; a gang (requests submitted together) enters whole or not at all."""
        num_prefill_tokens = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            unit = self._next_unit()
            if not unit:
                return
            num_new = sum(r.num_tokens - r.num_computed_tokens for r in unit)
            # A unit longer than the whole budget runs in a step of its own prefills.
            if num_prefill_tokens + num_new > budget and num_prefill_tokens > 0:
                return
            if not self._hold_kv_all(unit):
                if not self.running and not scheduled:  # the whole pool is free and still too small
                    error = RuntimeError(
                        f"request {unit[0].request_id} ({len(unit)} request(s) that must run together) needs "
                        f"{sum(r.num_tokens for r in unit)} KV slots but the whole pool has "
                        f"{self.allocator.num_free_tokens} free"
                    )
                    for req in unit:
                        self._finish(req, FinishReason.ERROR, error)
                        self.just_failed.append(req)
                    continue
                return
            self._start(unit, scheduled)
            num_prefill_tokens += num_new

    def _next_unit(self) -> list[Request]:
        head = self.waiting[0]
        if head.gang_id is None:
            return [head]
        gang = [r for r in self.waiting if r.gang_id == head.gang_id]
        room = self.config.max_num_seqs - len(self.running)
        # All or none: a gang shares values across its requests within one forward, so a split
        # would silently run part of it. The engine refuses gangs larger than max_num_seqs.
        return gang if len(gang) <= room else []

    def _hold_kv_all(self, unit: list[Request]) -> bool:
        held = []
        for req in unit:
            if not self._hold_kv(req, req.num_tokens):
                for done in held:
                    self._release_kv(done)
                return False
            held.append(req)
        return True

    def _start(self, unit: list[Request], scheduled: list[Request]) -> None:
        for req in unit:
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(req)

    def _schedule_running(self) -> tuple[list[Request], bool]:
        """Running requests, oldest first, each given KV for its next token, preempting if needed.

        Also says whether each of them brings exactly one new token after a cached prefix (a decode
        step, unless waiting requests join). A request whose pages already hold its next token (all
        but one step in `page_size`) costs a few int compares here: this loop runs every step.
        """
        scheduled: list[Request] = []
        is_decode = True
        page_size = self.allocator.page_size
        running = RequestStatus.RUNNING
        for req in list(self.running):
            if req.status is not running:
                continue  # preempted earlier in this loop
            num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            if req.req_pool_idx is None or num_tokens > len(req.page_ids) * page_size:
                while not self._hold_kv(req, num_tokens):
                    victim = self._pick_victim(exclude=scheduled)
                    if victim is None:
                        break
                    self._preempt(victim)
                    if victim is req:
                        break
                else:
                    scheduled.append(req)
                    is_decode = is_decode and 0 < req.num_computed_tokens == num_tokens - 1
                continue
            scheduled.append(req)  # it holds KV for its next token already: hold_kv would change nothing
            is_decode = is_decode and 0 < req.num_computed_tokens == num_tokens - 1
        return scheduled, is_decode

    def hold_decode_window(self, reqs: list[Request], num_steps: int) -> int:
        """Give each of `reqs` KV for `num_steps` decode steps up front, or for as many as the free pages allow.

        Returns the steps held for (at most `num_steps`; 1 means nothing beyond the next token, which
        `schedule` holds already). A window never preempts: all of its KV is taken from free pages
        before its first step, so nothing is preempted or allocated in its middle.
        """
        page_size = self.allocator.page_size
        num_free_pages = self.allocator.num_free_pages
        num_tokens = [len(req.prompt_token_ids) + len(req.output_token_ids) for req in reqs]
        num_held = [len(req.page_ids) * page_size for req in reqs]  # tokens each request's pages hold
        while num_steps > 1:
            # step j (0-based) writes the K/V of position num_tokens - 1 + j: num_tokens + num_steps - 1 slots in all
            short = [
                (req, n + num_steps - 1) for req, n, held in zip(reqs, num_tokens, num_held) if n + num_steps - 1 > held
            ]
            num_missing = sum(-(-end // page_size) - len(req.page_ids) for req, end in short)
            if num_missing <= num_free_pages:
                break
            num_steps -= 1
        if num_steps > 1:
            for req, end in short:
                held = self._hold_kv(req, end)
                assert held, "the free pages were counted"
        return num_steps

    def _pick_victim(self, exclude: list[Request]) -> Request | None:
        candidates = [r for r in self.running if r.is_preemptible and r not in exclude]
        return max(candidates, key=lambda r: r.arrival_order) if candidates else None

    def _preempt(self, req: Request) -> None:
        self._release_kv(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _hold_kv(self, req: Request, num_tokens: int) -> bool:
        return hold_kv(req, num_tokens, self.allocator, self.req_to_token_pool)

    def _release_kv(self, req: Request) -> None:
        release_kv(req, self.allocator, self.req_to_token_pool)

    # ---- after the step -------------------------------------------------------------------
    def process_batch_result(
        self, reqs: list[Request], next_token_ids: list[int], logprobs: list[dict[int, float] | None]
    ) -> list[Request]:
        """Append each request's new token and finish those that stop; returns the finished ones."""
        finished = []
        check = self.stop_checker.check
        finished_status = RequestStatus.FINISHED
        for req, token_id, token_logprobs in zip(reqs, next_token_ids, logprobs):
            if req.status is finished_status:
                continue
            if req.error is not None:
                self._finish(req, FinishReason.ERROR, req.error)
                finished.append(req)
                continue
            output = req.output_token_ids
            req.num_computed_tokens = len(req.prompt_token_ids) + len(output)
            output.append(token_id)
            if token_logprobs is not None:
                req.output_logprobs.append(token_logprobs)
            reason = check(req)
            if reason is not None:
                self._finish(req, reason)
                finished.append(req)
        return finished

    def fail_requests(self, reqs: list[Request], error: BaseException) -> list[Request]:
        for req in reqs:
            if not req.is_finished:
                self._finish(req, FinishReason.ERROR, req.error or error)
        return reqs

    def abort_requests(self, errors: dict[str, BaseException]) -> list[Request]:
        """Finish the waiting or running requests named in `errors`, each with its error."""
        aborted = [req for req in list(self.running) + list(self.waiting) if req.request_id in errors]
        for req in aborted:
            self._finish(req, FinishReason.ABORT, errors[req.request_id])
        return aborted

    def abort_all(self, error: BaseException) -> list[Request]:
        return self.fail_requests(list(self.running) + list(self.waiting), error)

    def _finish(self, req: Request, reason: FinishReason, error: BaseException | None = None) -> None:
        self._release_kv(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if error is not None:
            req.error = error
