"""EngineCore: one step of the engine (schedule, forward, sample, update), single-threaded."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from nnrun.forward_batch import ForwardBatch, ForwardMode
from nnrun.model_runner import LogitsProcessorOutput, ModelRunner
from nnrun.multi_step import decode_window_size, max_scheduler_steps, to_host_lists
from nnrun.request import Request
from nnrun.sampler import SamplerOutput, compute_logprobs
from nnrun.scheduler import Scheduler
from nnrun.stop import StopChecker

logger = logging.getLogger(__name__)


class StepFailedError(RuntimeError):
    """A step failed after this request's own code changed one of its values; the step ran again without it."""


@dataclass
class StepCounters:
    """Running totals since the engine started, kept by its thread and read as a snapshot by anyone.

    `batched_requests / forwards` is how many requests shared a forward on average: what decides
    throughput when a forward's fixed cost dominates, as it does for short traces on CPU.
    """

    forwards: int = 0  # model forwards run (a step run again without a request to blame counts twice)
    batched_requests: int = 0  # requests summed over those forwards
    forwarded_tokens: int = 0  # new tokens summed over those forwards
    finished_requests: int = 0  # requests ended, however they ended

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class DecodeChain:
    """The last decode step's batch and sampled tokens, from which the next decode step is advanced.

    Valid for a decode step whose requests are exactly `reqs`, in order: each of them then appended
    its token of `next_token_ids` and nothing else (no finish, preemption, abort or admission, each
    of which changes the running list or makes the step an extend) changed it.
    """

    reqs: list[Request]
    forward_batch: ForwardBatch
    next_token_ids: torch.Tensor  # [B] int64, the sampled tokens each request appended


class EngineCore:
    """Drives the runner with the scheduler; knows nothing about threads or callers."""

    def __init__(self, runner: ModelRunner, eos_token_ids: set[int]) -> None:
        self.runner = runner
        self.counters = StepCounters()
        self.stop_checker = StopChecker(eos_token_ids, runner.max_model_len, runner.tokenizer)
        self.scheduler = Scheduler(
            runner.config.scheduler, runner.allocator, runner.req_to_token_pool, self.stop_checker
        )
        self._decode_chain: DecodeChain | None = None
        self.max_scheduler_steps = max_scheduler_steps(runner.config)  # decode steps per decision, at most

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> tuple[list[Request], list[Request]]:
        """Run one step; returns (requests that got a token, requests that finished)."""
        with self.runner.step_lock:
            batch = self.scheduler.schedule()
            finished = self._drain_scheduler_failures()
            if batch is None:
                self._finish(finished)
                return [], finished
            reqs = batch.reqs
            num_steps = self._decode_window(reqs) if batch.forward_mode is ForwardMode.DECODE else 1
            try:
                if num_steps > 1:
                    ran, results = reqs, self._run_window(reqs, num_steps)
                else:
                    ran, (next_ids, token_logprobs) = self._run_groups(reqs, batch.forward_mode)
                    results = [(next_ids, token_logprobs, {})]
            except BaseException as error:  # a failure of the step itself: its requests end, the engine goes on
                logger.exception("engine step failed")
                finished += self.scheduler.fail_requests(reqs, error)
            else:
                if len(ran) != len(reqs):  # some requests' group failed: they end, the others go on
                    ran_ids = set(map(id, ran))
                    blamed = [req for req in reqs if id(req) not in ran_ids]
                    finished += self.scheduler.fail_requests(blamed, RuntimeError("the step failed"))
                for next_ids, token_logprobs, row_errors in results:  # step by step, as if scheduled one at a time
                    self._fail_rows(ran, row_errors)
                    finished += self.scheduler.process_batch_result(ran, next_ids, token_logprobs)
            finished += self._drain_scheduler_failures()
            self._finish(finished)
            return reqs, finished

    def _run_groups(self, reqs: list[Request], mode: ForwardMode) -> tuple[list[Request], tuple[list, list]]:
        """Run the step as the runner groups it (one packed forward, or one per request on the exact path)."""
        groups = self.runner.forward_groups(reqs)
        if len(groups) == 1 and len(groups[0]) == len(reqs):
            return self._run_isolated(reqs, mode)
        ran, next_ids, token_logprobs = [], [], []
        for group in groups:
            try:
                group_ran, (group_ids, group_logprobs) = self._run_isolated(group, mode)
            except BaseException as error:  # this group's forward failed: its requests end, the others ran
                logger.exception("engine forward failed")
                for req in group:
                    req.fail(error)
                continue
            ran += group_ran
            next_ids += group_ids
            token_logprobs += group_logprobs
        return ran, (next_ids, token_logprobs)

    def _run_isolated(self, reqs: list[Request], mode: ForwardMode) -> tuple[list[Request], tuple[list, list]]:
        """Run the step; if it fails, end the requests whose own code is to blame and run it again without them.

        Returns the requests that ran and their (token ids, logprobs). A failure nobody is to blame
        for (or that all of the step is to blame for) propagates: it is the engine's.
        """
        try:
            return reqs, self._run_batch(reqs, mode)
        except BaseException as error:
            blamed = self.runner.requests_to_blame(reqs)
            if not blamed or len(blamed) == len(reqs):
                raise
            for req in blamed:
                req.fail(
                    StepFailedError(
                        f"the engine step failed after request {req.request_id}'s intervention "
                        f"edited a value of the forward: {type(error).__name__}: {error}"
                    )
                )
            logger.warning(
                "a step failed after %d request(s) edited it (%s); running it again without them", len(blamed), error
            )
            rest = [req for req in reqs if req not in blamed]
            return rest, self._run_batch(rest, mode)

    def _run_batch(self, reqs: list[Request], mode: ForwardMode) -> tuple[list[int], list[dict[int, float] | None]]:
        """Forward and sample one batch -> (next token ids, their logprobs), in batch order."""
        if mode is ForwardMode.DECODE:
            forward_batch = self._first_decode_batch(reqs)
        else:
            self._decode_chain = None
            forward_batch = self.runner.prepare_forward_batch_extend(reqs)
        logits_output, sampler_output = self._forward_and_sample(forward_batch)
        self._fail_rows(reqs, sampler_output.row_errors)
        self._record_prompt_logprobs(reqs, logits_output)
        next_token_ids = sampler_output.token_ids.tolist()
        if mode is ForwardMode.DECODE and not sampler_output.row_errors:
            self._decode_chain = DecodeChain(list(reqs), forward_batch, sampler_output.token_ids)
        return next_token_ids, self._token_logprobs(reqs, sampler_output)

    def _decode_window(self, reqs: list[Request]) -> int:
        """Decode steps this batch runs before the next scheduling decision, its KV held for all of them."""
        num_steps = decode_window_size(
            reqs,
            self.max_scheduler_steps,
            self.stop_checker.max_model_len,
            self.runner,
            has_waiting=bool(self.scheduler.waiting),
        )
        return self.scheduler.hold_decode_window(reqs, num_steps) if num_steps > 1 else 1

    def _run_window(self, reqs: list[Request], num_steps: int) -> list[tuple[list[int], list, dict[int, str]]]:
        """`num_steps` decode steps of `reqs` back to back (`nnrun/multi_step.py`) -> per step (ids, logprobs, row errors).

        Each step's sampled tokens are the next step's input ids, on the device; nothing is read back
        until the last step has run. The engine appends the steps' tokens afterwards, in order.
        """
        forward_batch = self._first_decode_batch(reqs)
        outputs: list[SamplerOutput] = []
        for step in range(num_steps):
            if step:
                forward_batch = self.runner.advance_decode_batch(forward_batch, outputs[-1].token_ids)
            outputs.append(self._forward_and_sample(forward_batch)[1])
        step_token_ids = to_host_lists([output.token_ids for output in outputs])  # the window's one sync
        if not any(output.row_errors for output in outputs):
            self._decode_chain = DecodeChain(list(reqs), forward_batch, outputs[-1].token_ids)
        return [
            (token_ids, self._token_logprobs(reqs, output), output.row_errors)
            for token_ids, output in zip(step_token_ids, outputs)
        ]

    def _first_decode_batch(self, reqs: list[Request]) -> ForwardBatch:
        chain, self._decode_chain = self._decode_chain, None
        if chain is not None and chain.reqs == reqs:  # the same requests as the last decode step, one token on
            return self.runner.advance_decode_batch(chain.forward_batch, chain.next_token_ids)
        return self.runner.prepare_forward_batch_decode(reqs)

    def _forward_and_sample(self, forward_batch: ForwardBatch) -> tuple[LogitsProcessorOutput, SamplerOutput]:
        counters = self.counters
        counters.forwards += 1
        counters.batched_requests += forward_batch.batch_size
        counters.forwarded_tokens += forward_batch.num_tokens
        logits_output = self.runner.forward(forward_batch)
        return logits_output, self.runner.sample(logits_output, forward_batch)

    @staticmethod
    def _fail_rows(reqs: list[Request], row_errors: dict[int, str]) -> None:
        """Rows the sampler could not sample fail their requests (unless they stopped earlier in a window)."""
        for row, reason in row_errors.items():
            if not reqs[row].is_finished:
                reqs[row].fail(ValueError(f"request {reqs[row].request_id}: {reason}"))

    def abort_requests(self, errors: dict[str, BaseException]) -> list[Request]:
        """Finish the named requests now (those still waiting or running); returns them."""
        if not errors:
            return []
        with self.runner.step_lock:
            finished = self.scheduler.abort_requests(errors)
            self._finish(finished)
            return finished

    def abort_all(self, error: BaseException) -> list[Request]:
        with self.runner.step_lock:
            finished = self.scheduler.abort_all(error)
            self._finish(finished)
            return finished

    def _finish(self, finished: list[Request]) -> None:
        if not finished:
            return
        self.counters.finished_requests += len(finished)
        # No detokenizing here: a finished request's text is made when someone reads it
        # (`StopChecker.final_text`), and most of a trace's requests are never read as text.
        try:
            self.runner.finish_requests(finished)
        except BaseException as error:
            logger.exception("runner.finish_requests failed")
            for req in finished:
                req.fail(error)

    def _drain_scheduler_failures(self) -> list[Request]:
        failed, self.scheduler.just_failed = self.scheduler.just_failed, []
        return failed

    @staticmethod
    def _token_logprobs(reqs: list[Request], out: SamplerOutput) -> list[dict[int, float] | None]:
        if out.logprobs is None:  # no row asked: nothing per request
            return [None] * len(reqs)
        result: list[dict[int, float] | None] = []
        for row, req in enumerate(reqs):
            num_top = req.sampling_params.logprobs
            if num_top is None or out.logprobs is None:
                result.append(None)
                continue
            entry = {}
            if num_top and out.top_logprob_ids is not None:
                ids, lps = out.top_logprob_ids[row, :num_top].tolist(), out.top_logprobs[row, :num_top].tolist()
                entry.update(zip(ids, lps))
            entry[int(out.token_ids[row])] = float(out.logprobs[row])
            result.append(entry)
        return result

    @staticmethod
    def _record_prompt_logprobs(reqs: list[Request], logits_output: LogitsProcessorOutput) -> None:
        if logits_output.prompt_logits is None:
            return
        for req, logits in zip(reqs, logits_output.prompt_logits):
            if logits is None:
                continue
            num_top = req.sampling_params.prompt_logprobs
            targets = torch.tensor(req.prompt_token_ids[1:], dtype=torch.int64, device=logits.device)  # [T-1]
            target_lps, top_ids, top_lps = compute_logprobs(logits, targets, num_top)
            entries: list[dict[int, float] | None] = [None]
            for pos, (target, lp) in enumerate(zip(targets.tolist(), target_lps.tolist())):
                entry = dict(zip(top_ids[pos].tolist(), top_lps[pos].tolist())) if top_ids is not None else {}
                entry[target] = lp
                entries.append(entry)
            req.prompt_logprobs = entries
