"""TensorParallelNNsightRunner: the nnsight bridge's front end when the model lives on tensor-parallel ranks.

The user's process keeps what it keeps with one device (the scheduler, the client tree, each
trace's `TraceJob` that its caller waits on) but runs no block: every rank does
(interleaver/tp_rank.py). A step with a traced request goes to the ranks as one exchange, with
the traces they have not seen yet; rank 0 answers with the sampled tokens. When traced requests
finish, the ranks finalize their blocks and rank 0 sends back what each saved, which lands on
the caller's invocations as if the blocks had run here. Steps with no traced request take the
plain tensor-parallel path (only argmaxes or logits cross).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

import nnrun.tp.wire as wire
from interleaver.batcher import PackedBatcher
from interleaver.jobs import TraceJob
from interleaver.mediator import PackedInterleaver
from interleaver.tp_rank import StepAnswer, StepRow
from interleaver.tp_ship import apply_results
from nnrun.forward_batch import ForwardBatch
from nnrun.model_runner import LogitsProcessorOutput
from nnrun.request import Request
from nnrun.sampler import SamplerOutput
from nnrun.tp import TensorParallelRunner


class RankStepFailedError(RuntimeError):
    """The ranks' forward failed after some blocks edited it; the engine runs the step again without them."""


@dataclass
class RankSamplerOutput(LogitsProcessorOutput):
    """A step the ranks sampled: rank 0's sampler output, no logits."""

    sampler_output: SamplerOutput | None = None


class TensorParallelNNsightRunner(TensorParallelRunner):
    """Schedules traced requests here; their blocks run on every rank."""

    rank_runner = "interleaver.tp_rank:NNsightShardRunner"
    ships_jobs = True  # the caller serializes each trace for the ranks (`interleaver.tp_ship.ship_job`)

    def load_model(self) -> None:
        super().load_model()
        # The client tree's interleaver asks the engine's whether it is interleaving: here it never is.
        self.interleaver = PackedInterleaver(PackedBatcher(None))
        self.jobs: dict[int, TraceJob] = {}  # seq -> a trace the ranks hold, until it is done
        self._blamed: set[str] = set()

    def keeps_all_logits(self, req: Request) -> bool:
        job = _job_of(req)
        return job is not None and job.kind == "trace" and req.num_computed_tokens == 0

    # ---- a step ------------------------------------------------------------------------------
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        if not any(_job_of(req) is not None for req in forward_batch.reqs):
            return super().forward(forward_batch)
        message = {
            "op": "step",
            "jobs": self._unshipped(forward_batch.reqs),
            "step": bytes(wire.encode_step(forward_batch, self.allocator.page_size)),
            "rows": [_step_row(req) for req in forward_batch.reqs],
            "next_token_logits_rows": forward_batch.next_token_logits_rows,
            "prompt_logits_rows": forward_batch.prompt_logits_rows,
            "eos_token_ids": self.eos_token_ids,
        }
        answer: StepAnswer = pickle.loads(self.group.exchange(pickle.dumps(message)))
        if answer.step_error is not None:
            self._blamed = set(answer.blamed)
            raise RankStepFailedError(f"the step failed on the tensor-parallel ranks: {answer.step_error}")
        for req in forward_batch.reqs:
            state = answer.generator_states.get(req.request_id)
            if state is not None and req.generator is not None:
                req.generator.set_state(state)
            error = answer.failed.get(req.request_id)
            if error is not None:
                req.fail(error)
        return RankSamplerOutput(
            next_token_logits=torch.empty((forward_batch.batch_size, 0)), sampler_output=answer.sampler_output
        )

    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> SamplerOutput:
        if isinstance(logits_output, RankSamplerOutput):
            return logits_output.sampler_output
        return super().sample(logits_output, forward_batch)

    def requests_to_blame(self, reqs: list[Request]) -> list[Request]:
        blamed, self._blamed = self._blamed, set()
        return [req for req in reqs if req.request_id in blamed]

    def _unshipped(self, reqs: list[Request]) -> list[bytes]:
        """The traces of `reqs` the ranks have not seen yet, each once, in submission order."""
        payloads = []
        for req in reqs:
            job = _job_of(req)
            if job is not None and job.seq not in self.jobs:
                if job.shipped is None:
                    raise RuntimeError(
                        "a trace reached a tensor-parallel engine without its blocks serialized "
                        "(nnrun.LanguageModel ships them; submit traces through it)"
                    )
                self.jobs[job.seq] = job
                payloads.append(job.shipped)
        return payloads

    # ---- blocks: they run on the ranks, never on this process's threads ------------------------
    def num_live_blocks(self) -> int:
        return sum(not inv.is_finished for job in self.jobs.values() for inv in job.invocations)

    def running_block(self) -> Any | None:
        return None

    def interrupt_blocks(self, mediators: list[Any]) -> bool:
        return False

    def interrupt_running_blocks(self) -> bool:
        return False

    # ---- finishing ---------------------------------------------------------------------------
    def finish_requests(self, reqs: list[Request]) -> None:
        super().finish_requests(reqs)
        traced = [req for req in reqs if _job_of(req) is not None]
        if not traced:
            return
        jobs = {id(job): job for job in map(_job_of, traced)}
        try:
            message = {
                "op": "finish",
                "jobs": self._unshipped(traced),
                "requests": [(req.request_id, list(req.output_token_ids)) for req in traced],
            }
            done = apply_results(self.group.exchange(pickle.dumps(message)), self.jobs)
        except BaseException as error:
            _fail_jobs(jobs.values(), error)
            for job in jobs.values():
                self.jobs.pop(job.seq, None)
            raise
        for job in done:
            del self.jobs[job.seq]
            job.done.set()

    def shutdown(self) -> None:
        _fail_jobs(self.jobs.values(), RuntimeError("the engine stopped before this trace's blocks finished"))
        self.jobs.clear()
        super().shutdown()


def _job_of(req: Request) -> TraceJob | None:
    return req.extra_args.get("nnsight")


def _step_row(req: Request) -> StepRow:
    generator_state = req.generator.get_state() if req.generator is not None else None
    row = StepRow(req.request_id, req.num_computed_tokens, list(req.output_token_ids), generator_state)
    if _job_of(req) is None:  # the ranks keep no copy of a request no trace owns
        row.prompt_token_ids = req.prompt_token_ids
        row.sampling_params = req.sampling_params
        row.extra_args = req.extra_args
    return row


def _fail_jobs(jobs: Any, error: BaseException) -> None:
    """End the waits of traces whose blocks can no longer report (the ranks failed or stopped)."""
    for job in list(jobs):
        for invocation in job.invocations:
            if not invocation.is_finished:
                invocation.is_finished = True
                invocation.error = invocation.error or error
        job.done.set()
