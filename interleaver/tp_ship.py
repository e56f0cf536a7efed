"""What the nnsight bridge sends to tensor-parallel ranks and back.

Every rank runs every block (nnsight's rule for sharded models: each rank reaches the same
collectives in the same order, and nnsight's `TPFragments` gathers a sharded value before a block
sees it), so a trace's blocks travel to the ranks, and rank 0's saves travel back:

- `ship_job`: a trace's invocations (each mediator reduced by nnsight's own serialization to its
  source and the names it reads) and its requests, in one pickle, so a value two invokes share
  stays one object on the ranks. Envoys of the caller's tree are sent by path
  (`tag_envoys`) and resolve to the rank's own tree (`RankEnvoys`).
- `ship_results` / `apply_results`: each finished invocation's saved values, error and warning;
  plus the values saved *above* its block (a list the invokes append to), by name.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from nnsight.intervention import serialization
from nnsight.intervention.eproperty import eproperty

from interleaver.jobs import Invocation, TraceJob
from nnrun.request import Request
from nnrun.sampling_params import SamplingParams

ENVOY_ID = "Envoy:"  # persistent id of a client envoy: this prefix and its path


def tag_envoys(root: Any) -> None:
    """Mark every envoy of a client tree to travel by path (its module and engine stay here)."""
    for path, envoy in root.modules(names=True):
        envoy.__dict__["_persistent_id"] = ENVOY_ID + path


class RankEnvoys(dict):
    """A rank's persistent objects for nnsight's unpickler: `Envoy:<path>` -> the rank's envoy at that path."""

    def __init__(self, root: Any) -> None:
        super().__init__({ENVOY_ID + path: envoy for path, envoy in root.modules(names=True)})
        self.root = root
        self.client_class: type | None = None

    def serve_as(self, client_class: type) -> None:
        """Give the rank's root the caller's served values (`nnrun.VLLM`'s `[1, 1]` `model.samples`).

        One engine serves one client class, so this happens once: the root becomes a subclass of its
        own class carrying the client class's eproperties.
        """
        if client_class is self.client_class:
            return
        served = {}
        for klass in reversed(client_class.__mro__):
            served.update({name: attr for name, attr in vars(klass).items() if isinstance(attr, eproperty)})
        base = type(self.root) if self.client_class is None else type(self.root).__bases__[0]
        self.root.__class__ = type(f"Rank{client_class.__name__}", (base,), served)
        self.client_class = client_class


# ---- front end -> ranks: jobs ----------------------------------------------------------------
@dataclass
class ShippedJob:
    """A trace as the ranks rebuild it: no events, threads, streamers or engine handles."""

    seq: int
    kind: str
    needs_grad: bool
    pad_token_id: int
    pushes_every_name: bool
    client_class: type  # the caller's model class: its values (`model.samples`) are served as that class serves them
    invocations: list[tuple[Any, list[str], int, bool]]  # (mediator, request ids, index, is_edit)
    requests: list[tuple[str, list[int], SamplingParams, dict]]  # (id, prompt ids, params, extra args)


def refuse_on_ranks(job: TraceJob) -> None:
    """What tensor-parallel ranks do not serve yet, refused by name before anything is sent."""
    if job.needs_grad:
        raise NotImplementedError(
            "gradients (.grad, .backward(), retain_grad()) are not served on tensor-parallel ranks yet: a backward "
            "through the ranks' gathered values does not reach the same collectives on every rank. Run this trace "
            "with tensor_parallel_size=1"
        )


def ship_job(job: TraceJob, client_class: type) -> bytes:
    """Serialized on the caller's thread, before it submits: nnsight records there which names were saved."""
    return serialization.dumps(_shipped(job, client_class))


def _shipped(job: TraceJob, client_class: type) -> ShippedJob:
    invocations = [(inv.mediator, list(inv.request_ids), inv.index, inv.is_edit) for inv in job.invocations]
    requests = [
        (rid, list(req.prompt_token_ids), req.sampling_params, _plain_args(req.extra_args))
        for rid, req in job.requests.items()
    ]
    return ShippedJob(
        job.seq, job.kind, job.needs_grad, job.pad_token_id, job.pushes_every_name, client_class, invocations, requests
    )


def _plain_args(extra_args: dict) -> dict:
    return {key: value for key, value in extra_args.items() if key != "nnsight"}


def receive_jobs(payloads: list[bytes], envoys: RankEnvoys, device: torch.device) -> list[TraceJob]:
    """The jobs as the rank runs them: its own `TraceJob`s over mirror requests of the front end's."""
    jobs = []
    for payload in payloads:
        shipped = serialization.loads(payload, envoys)
        envoys.serve_as(shipped.client_class)
        invocations = [
            Invocation(mediator, request_ids, index, is_edit=is_edit)
            for mediator, request_ids, index, is_edit in shipped.invocations
        ]
        # The invokes of one trace see each other's binds (a name one binds, a later one reads), as
        # blocks written in one frame do: nnsight's serialization ships each alone, so they share again here.
        shared: dict = {}
        for invocation in invocations:
            if not invocation.is_edit:
                invocation.mediator.lcls.shared = shared
        job = TraceJob(
            shipped.kind,
            invocations,
            needs_grad=shipped.needs_grad,
            pad_token_id=shipped.pad_token_id,
            seq=shipped.seq,
            ids_device=device,
            pushes_every_name=shipped.pushes_every_name,
        )
        for rid, prompt, params, extra_args in shipped.requests:
            job.requests[rid] = Request(rid, prompt, params, extra_args={"nnsight": job, **extra_args})
        jobs.append(job)
    return jobs


# ---- ranks -> front end: what finished blocks left ---------------------------------------------
@dataclass
class InvocationResult:
    seq: int
    position: int  # the invocation's place in its job's list (stored edits first, as shipped)
    saves: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    warning: str | None = None


def ship_results(invocations: list[Invocation]) -> bytes:
    results = []
    for invocation in invocations:
        job = invocation.job
        lcls = invocation.mediator.lcls
        saves = dict(lcls.writes() if job.pushes_every_name else invocation.saves)
        for name in invocation.mediator.presaved:  # saved above the block: its value as the block left it
            if name in lcls and name not in saves:
                saves[name] = lcls[name]
        results.append(
            InvocationResult(
                job.seq, job.invocations.index(invocation), saves, portable_error(invocation.error), invocation.warning
            )
        )
    return serialization.dumps(results)


def portable_error(error: BaseException | None) -> BaseException | None:
    """The block's error as one that pickles, with the rank's traceback in its message if it had to be rebuilt."""
    if error is None:
        return None
    error.__traceback__ = None
    error.__dict__.pop("__intervention_tb__", None)
    try:
        serialization.dumps(error)
        return error
    except Exception:
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        return RuntimeError(f"a block raised on a tensor-parallel rank: {text}")


def apply_results(payload: bytes, jobs: dict[int, TraceJob]) -> list[TraceJob]:
    """Record rank 0's results on the front end's invocations; returns the jobs that are now done."""
    touched: dict[int, TraceJob] = {}
    for result in serialization.loads(payload):
        job = jobs.get(result.seq)
        if job is None:
            continue
        invocation = job.invocations[result.position]
        invocation.is_finished = True
        invocation.error = invocation.error or result.error
        invocation.warning = result.warning
        invocation.saves = result.saves
        for name, value in result.saves.items():  # what `push_result` pushes into the caller's frame
            invocation.mediator.lcls[name] = value
        touched[result.seq] = job
    return [job for job in touched.values() if all(inv.is_finished for inv in job.invocations)]
