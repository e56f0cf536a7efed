"""NNsightRequestHelper: the runner's book of which mediator serves which engine requests.

A trace is a `TraceJob` of `Invocation`s (interleaver/jobs.py). The client submits one engine
request per prompt with the job in `extra_args["nnsight"]`, and waits on `job.done`. On the engine
thread the helper:

1. `process_new_reqs`: learns a request's job the first time a step carries it;
2. `process_batch_groups`: every step, gives each invocation with a request in the step a
   `PackedGroup` (its requests' token spans, logit spans and rows, in the runner's batch order)
   and returns the invocations in serving order (trace submission order, then invoke order);
3. `start`: starts an invocation's mediator the first step one of its requests is scheduled;
4. `end_step`: ends the requests of any invocation whose block raised (or called `stop()`);
5. `process_finished_reqs` / `finish`: once every request of an invocation is finished (of a
   generation: every request of its trace), serves `model.generator.output` and `tracer.result`,
   unwinds a worker still parked, and records the block's saved values; the last invocation of a
   job sets `job.done`.

Mediators are greenlets: everything here runs on the engine thread.
"""

from __future__ import annotations

from typing import Any

import torch
from greenlet import error as GreenletError

from nnsight.intervention.interleaver import EarlyStopException, dangling_unwind
from nnsight.tracing.tracer import inc

from interleaver.batcher import PackedGroup
from interleaver.generator import GENERATOR_OUTPUT, NOT_SERVED, serve_generated_ids
from interleaver.jobs import Invocation, TraceJob, pad_sequences
from interleaver.mediator import PackedInterleaver, PackedMediator, as_block_error
from interleaver.nnsight_private import saved_value_ids, tracing_thread_state
from interleaver.save_spill import SavedValueLedger
from interleaver.saved_copies import unpin_block_saves, unpin_client_saves
from nnrun.forward_batch import ForwardBatch
from nnrun.request import Request
from nnrun.save_budget import SaveBudget

RESULT_LOCATION = "result"
# Where a block waits for its trace's end: `finish` serves these after the last step.
FINISH_LOCATIONS = frozenset({RESULT_LOCATION, GENERATOR_OUTPUT})


class NNsightRequestHelper:
    """Request id -> invocations, batch groups per step, and finishing (engine thread only)."""

    def __init__(self, interleaver: PackedInterleaver, saved_values: SavedValueLedger | None = None) -> None:
        self.interleaver = interleaver
        # The running traces' saved values against the engine's budgets (unlimited unless the runner gives one).
        self.saved_values = saved_values or SavedValueLedger(SaveBudget(1 << 62, 1 << 62))
        self.request_to_invocations: dict[str, list[Invocation]] = {}
        self.live: dict[Invocation, None] = {}  # known and not yet finished, in the order they became known
        self.step_invocations: list[Invocation] = []
        # Whether some block of this step may still read or write one of its values (`watches_step`): if
        # none does, the step runs as an untraced one (graph replay included), with no handoff at all.
        self.is_watched = False
        self._grad_of_batch: tuple[ForwardBatch, bool] | None = None  # the last step's `needs_grad`

    @property
    def has_requests(self) -> bool:
        return bool(self.request_to_invocations)

    def needs_grad(self, forward_batch: ForwardBatch) -> bool:
        """Whether a trace with a request in this step reads `.grad` or calls `.backward()` (asked several
        times a step: worked out once per step)."""
        if not self.request_to_invocations:
            return False
        known = self._grad_of_batch
        if known is not None and known[0] is forward_batch:
            return known[1]
        needs = any(
            inv.job.needs_grad
            for req in forward_batch.reqs
            for inv in self.request_to_invocations.get(req.request_id, ())
        )
        self._grad_of_batch = (forward_batch, needs)
        return needs

    def wants_all_logits(self, req: Request) -> bool:
        """A traced prompt keeps the logits of every position, as HF's forward does."""
        job = req.extra_args.get("nnsight")
        return job is not None and job.kind == "trace" and req.num_computed_tokens == 0

    # ---- 1. new requests ------------------------------------------------------------------
    def process_new_reqs(self, reqs: list[Request]) -> None:
        for req in reqs:
            job: TraceJob | None = req.extra_args.get("nnsight")
            if job is None or req.request_id in self.request_to_invocations:
                continue
            invocations = job.invocations_of(req.request_id)
            self.request_to_invocations[req.request_id] = invocations
            for invocation in invocations:
                self.live.setdefault(invocation)

    # ---- 2. per-step groups ---------------------------------------------------------------
    def process_batch_groups(self, forward_batch: ForwardBatch, logit_spans: list[tuple[int, int]]) -> list[Invocation]:
        """Point each invocation at its requests' places in this step; return them in serving order."""
        self.saved_values.wait_copies()  # the last step's host copies, before any block runs again
        row_of = {req.request_id: row for row, req in enumerate(forward_batch.reqs)}
        starts, lengths = forward_batch.extend_start_loc, forward_batch.extend_seq_lens
        scheduled = []
        for invocation in self.live:
            mediator = invocation.mediator
            rows = [row_of[rid] for rid in invocation.request_ids if rid in row_of]
            if not rows:
                mediator.batch_group = None
                continue
            mediator.batch_group = PackedGroup(
                [(starts[row], lengths[row]) for row in rows], [logit_spans[row] for row in rows], rows
            )
            mediator.edited_at = None
            scheduled.append(invocation)
        scheduled.sort(key=_serving_order)
        self.step_invocations = scheduled
        self.is_watched = bool(scheduled)  # until `watch_step` has looked at the started blocks
        return scheduled

    # ---- 3. starting ----------------------------------------------------------------------
    def start(self, invocations: list[Invocation]) -> None:
        """Start invocations scheduled for the first time; shift those that sat steps out."""
        interleaver = self.interleaver
        if not getattr(tracing_thread_state, "depth", 0):
            inc()  # `.save()` inside a worker needs an open trace depth on this (the engine) thread
        if len(invocations) < len(self.live):  # some sit this step out
            running = set(map(id, invocations))
            for invocation in self.live:
                if invocation.is_started and id(invocation) not in running and invocation.mediator.alive:
                    if invocation.counts_when_out is None:
                        invocation.counts_when_out = dict(interleaver.counts)
        for invocation in invocations:
            mediator = invocation.mediator
            if invocation.counts_when_out is not None:  # its own occurrences skip the steps it sat out
                for location, count in interleaver.counts.items():
                    skipped = count - invocation.counts_when_out.get(location, 0)
                    mediator.counts_at_start[location] = mediator.counts_at_start.get(location, 0) + skipped
                invocation.counts_when_out = None
            if invocation.is_started:
                continue
            invocation.is_started = True
            try:
                mediator.start(interleaver)
            except BaseException as error:  # the block raised before its first park
                mediator.exception = as_block_error(error)
        interleaver.mediators = [inv.mediator for inv in invocations if _is_serving(inv.mediator)]
        interleaver.reindex()

    def watch_step(self) -> bool:
        """After `start`: whether a block of the step may still touch it; if none, the interleaver stands down.

        A block that finished, or waits only for its trace's end (`tracer.result`, the generated ids),
        touches no step again. One parked anywhere else may: on a module, or on the step's sampling
        (`model.logits`), after which it reads the next steps' modules by their visit counts, which
        only a traced step keeps. With the interleaver standing down (no mediators, not busy), every
        module runs its plain forward and a decode step may replay its graph.
        """
        self.is_watched = any(_watches_steps(inv.mediator) for inv in self.step_invocations)
        if not self.is_watched:
            self.interleaver.mediators = []
            self.interleaver.reindex()
        return self.is_watched

    def steps_unwatched(self, reqs: list[Request]) -> bool:
        """Whether no block riding on `reqs` can touch a step again, so they may run decode windows.

        A block that finished, or waits only for its trace's end, stays so until the trace finishes
        (only `finish` serves those locations): a job found so is marked `is_retired` and not looked at again.
        """
        for req in reqs:
            job: TraceJob | None = req.extra_args.get("nnsight")
            if job is None or job.is_retired:
                continue
            if job.needs_grad or not all(
                inv.is_started and not _watches_steps(inv.mediator) for inv in job.invocations
            ):
                return False
            job.is_retired = True
        return True

    def editors_in_step(self) -> list[Invocation]:
        """The step's invocations whose blocks changed a value of the forward."""
        return [inv for inv in self.step_invocations if inv.mediator.edited_at is not None]

    def keep_running(self) -> bool:
        """Narrow the interleaver to workers still parked; True if any is."""
        interleaver = self.interleaver
        interleaver.mediators = [inv.mediator for inv in self.step_invocations if _is_serving(inv.mediator)]
        interleaver.reindex()
        return bool(interleaver.mediators)

    # ---- 4. requests whose block raised or stopped ------------------------------------------
    def end_step(self, forward_batch: ForwardBatch) -> None:
        """Copy saved values out of the step's tensors, fail requests whose block raised or stopped."""
        if self.is_watched:  # (no block read anything of an unwatched step)
            self._copy_and_account_saves()
        in_step: dict[str, Request] | None = None
        for invocation in self.step_invocations:
            error = invocation.mediator.exception
            if error is None:
                continue
            if in_step is None:
                in_step = {req.request_id: req for req in forward_batch.reqs}
            for request_id in invocation.request_ids:
                req = in_step.get(request_id)
                if req is not None:
                    req.fail(error)
        self.step_invocations = []
        self.is_watched = False
        self.interleaver.mediators = []

    def _copy_and_account_saves(self) -> None:
        """Copy the step's saved views out of its tensors and count the new saved values, in one walk (past the
        device budget they go to the host); a trace whose values fit in neither budget fails alone."""
        for job, error in self.saved_values.copy_and_account(self.step_invocations).items():
            for invocation in job.invocations:
                if invocation.mediator.exception is None:
                    invocation.mediator.exception = error

    # ---- 5. finishing ---------------------------------------------------------------------
    def process_finished_reqs(self, reqs: list[Request]) -> list[Invocation]:
        """Note finished requests; return the invocations none of whose requests is still running.

        A generation's invocations wait for every request of their trace: its ids (`tracer.result`,
        `model.generator.output`) are padded to the whole trace, as HF pads its batch.
        """
        self.process_new_reqs(reqs)  # a request can finish (fail) before any step carried it
        finished_ids = {req.request_id for req in reqs}
        ready: dict[Invocation, None] = {}  # in the order found
        generations: set[int] = set()  # generation jobs looked at: the answer is the same for each of their requests
        for req in reqs:
            for finished in self.request_to_invocations.pop(req.request_id, ()):
                job = finished.job
                if job.kind == "generate":
                    if id(job) in generations:
                        continue
                    generations.add(id(job))
                    waiting, request_ids = job.invocations, job.requests
                else:
                    waiting, request_ids = [finished], finished.request_ids
                if not all(job.requests[rid].is_finished or rid in finished_ids for rid in request_ids):
                    continue
                for invocation in waiting:
                    if not (invocation.is_finished or invocation in ready or invocation not in self.live):
                        ready[invocation] = None
        return list(ready)

    def finish(self, invocations: list[Invocation]) -> None:
        """Serve `result`, unwind, record saves; set `done` on jobs whose invocations all finished."""
        self.saved_values.wait_copies()  # saved values moved to the host, before a block or the caller reads them
        memo: dict[int, Any] = {}  # one copy per saved view, whoever holds it
        padded_ids: dict[int, torch.Tensor] = {}  # per generation job, its ids padded to the trace (made once)
        for invocation in invocations:
            self._finish_one(invocation, memo, padded_ids)
            del self.live[invocation]
        jobs = list({id(inv.job): inv.job for inv in invocations}.values())
        # Once per job, after every block of it had its last word (`tracer.result`, an unwind).
        unpin_client_saves(jobs, memo)
        if invocations:  # a step that failed before sampling leaves its workers here
            self.step_invocations = [inv for inv in self.step_invocations if not inv.is_finished]
            self.interleaver.mediators = [inv.mediator for inv in self.step_invocations]
        for job in jobs:
            if all(inv.is_finished for inv in job.invocations):
                job.results.clear()  # the step's logits, kept only to serve `tracer.result`
                self.saved_values.release(job)
                job.done.set()
        if not self.request_to_invocations and not self.live:
            saved_value_ids().clear()  # nothing in flight: no saved id can still matter
            self.interleaver.sourced.clear()  # nor a callable some block drilled into (`op.source`)

    def _finish_one(self, invocation: Invocation, memo: dict[int, Any], padded_ids: dict[int, torch.Tensor]) -> None:
        mediator = invocation.mediator
        invocation.is_finished = True
        mediator.batch_group = None
        job = invocation.job
        generated: Any = NOT_SERVED  # the ids are built only for a block that reads them
        if job.kind == "generate" and mediator.alive:
            generated = serve_generated_ids(invocation, lambda: _generated_rows(invocation, padded_ids))
        if mediator.alive and mediator.is_waiting_for(RESULT_LOCATION):
            if job.kind == "generate" and generated is NOT_SERVED:
                generated = _generated_rows(invocation, padded_ids)
            try:
                mediator.handle(RESULT_LOCATION, self._result_of(invocation, generated))
            except BaseException as error:
                mediator.exception = as_block_error(error)
        if mediator.alive and mediator.pending is not None:
            self._unwind(invocation)
        # An edit's names are never pushed, so it unpins and claims no save: a value it bound may be an invoke's.
        if not invocation.is_edit:
            unpin_block_saves([invocation], memo)
        error = mediator.exception
        if error is not None and not isinstance(error, EarlyStopException) and invocation.error is None:
            invocation.error = error
        saved = saved_value_ids()  # only names the block bound: its scope also holds the caller's snapshot
        writes = {} if invocation.is_edit else mediator.lcls.writes()
        invocation.saves = {name: value for name, value in writes.items() if id(value) in saved}
        for value in invocation.saves.values():
            saved.discard(id(value))
        mediator.worker = None  # frees the greenlet and its frames
        mediator.interleaver = None
        mediator.batch_group = None

    def _unwind(self, invocation: Invocation) -> None:
        mediator = invocation.mediator
        error, expected = dangling_unwind(mediator)
        try:
            mediator.worker.throw(error)
        except GreenletError:
            return
        except BaseException as thrown:
            if expected is not None and thrown is error:
                invocation.warning = expected
            elif mediator.exception is None:
                mediator.exception = as_block_error(thrown)
            return
        mediator.pending = None

    def _result_of(self, invocation: Invocation, generated: torch.Tensor | None) -> Any:
        """What `tracer.result` is: the model output of a trace, the token ids of a generation.

        `generated`: a generation's ids as `model.generator.output` left them (a block may assign them).
        """
        job = invocation.job
        if job.make_result is not None:
            return job.make_result([job.requests[rid] for rid in invocation.request_ids])
        if job.kind == "trace":
            logits = [job.results.get(rid) for rid in invocation.request_ids]
            return _stack_outputs(job.output_type, logits)
        return generated


def _serving_order(invocation: Invocation) -> tuple[int, int]:
    """Trace submission order, then invoke order (a trace's stored edits first)."""
    return invocation.job.seq, invocation.index


def _watches_steps(mediator: PackedMediator) -> bool:
    """A block observing the run (`tracer.cache()`), or parked anywhere but its trace's end (see `watch_step`)."""
    if mediator.caches:
        return True
    if not mediator.alive:
        return False
    pending = mediator.pending
    return pending is None or pending.provider not in FINISH_LOCATIONS


def _is_serving(mediator: PackedMediator) -> bool:
    """A block still parked, or one whose `tracer.cache()` observes the rest of its run."""
    return mediator.alive or bool(mediator.caches)


def _stack_outputs(output_type: type, logits: list[torch.Tensor | None]) -> Any:
    """One request's model output as is; several stacked as HF stacks a left-padded batch."""
    if any(t is None for t in logits):
        return None if logits[0] is None else output_type(logits=logits[0])
    if len(logits) == 1:
        return output_type(logits=logits[0])
    max_len = max(t.shape[1] for t in logits)  # each [1, T_i, V]
    padded = logits[0].new_zeros((len(logits), max_len, logits[0].shape[-1]))  # [k, T_max, V]
    for i, t in enumerate(logits):
        padded[i, max_len - t.shape[1] :] = t[0]
    return output_type(logits=padded)


def padded_generated_ids(job: TraceJob) -> torch.Tensor:
    """A generation's ids, every request of the trace padded as HF pads its batch: `[B, T_max + new_max]`."""
    requests = list(job.requests.values())
    return pad_sequences(
        [r.all_token_ids for r in requests],
        [len(r.prompt_token_ids) for r in requests],
        job.pad_token_id,
        job.ids_device,
    )


def _generated_rows(invocation: Invocation, padded_ids: dict[int, torch.Tensor]) -> torch.Tensor:
    """An invocation's rows of its generation's padded ids, the padded matrix made once per job (`padded_ids`).

    Rows are taken by advanced indexing, a copy each, so one block assigning its ids never changes another's.
    """
    job = invocation.job
    if id(job) not in padded_ids:
        padded_ids[id(job)] = padded_generated_ids(job)
    row_of = {request_id: row for row, request_id in enumerate(job.requests)}
    return padded_ids[id(job)][[row_of[request_id] for request_id in invocation.request_ids]]  # [k, T_max + new_max]
