"""Edits (`model.edit()`): blocks stored on the model and replayed on every later trace.

nnsight stores an edit as a mediator on the envoy (`envoy._edits`); `Envoy.interleave` puts the
stored mediators in front of each run's workers with no batch group, so an edit sees the whole
batch and is served before any invoke at every location. nnrun's traces never reach
`interleave` (the engine runs them), so the job builder does the same here: each stored edit
becomes one invocation spanning every request of the trace (every prompt of every invoke), built
afresh per trace from the stored block, ordered before the trace's own invokes. Like an empty
invoke, it is served its requests gathered and left-padded as HF pads the batch.

An edit's names are its own: as on HF, nothing it binds (or saves) is pushed to the caller, and
a loop it leaves open (`tracer.iter[:]`) ends with nnsight's warning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from nnsight.intervention.interleaver import Mediator

from interleaver.jobs import Invocation, pad_sequences
from interleaver.mediator import PackedMediator
from interleaver.tracer import PendingInvoke, _asks_for_grad

if TYPE_CHECKING:
    from interleaver.jobs import TraceJob

# The body of a plain `generate(...)` call: it only carries the prompts, the edits do the work.
_EMPTY_BLOCK = compile("pass", "<nnrun: generate without a block>", "exec")


def replay(edit: Mediator) -> PackedMediator:
    """A fresh worker for one trace from a stored edit (its own scope, so replays share nothing)."""
    return PackedMediator(edit.code, edit.glbls, dict(edit.lcls), node=edit.node)


def edit_invocations(edits: Sequence[Mediator], request_ids: list[str]) -> list[Invocation]:
    """One invocation per stored edit over every request, indexed before the invokes (which start at 0)."""
    count = len(edits)
    return [
        Invocation(replay(edit), list(request_ids), index - count, is_edit=True) for index, edit in enumerate(edits)
    ]


def edits_ask_for_grad(edits: Sequence[Mediator]) -> bool:
    """Whether a stored edit reads `.grad` or calls `.backward()` (its trace then runs with autograd)."""
    return any(_asks_for_grad(edit.node) for edit in edits)


def generate_with_edits(model: Any, inputs: tuple, kwargs: dict) -> torch.Tensor:
    """`edited.generate(prompt, ...)` without a block: as on HF, the stored edits still apply."""
    invoke = PendingInvoke(PackedMediator(_EMPTY_BLOCK, {}, {}), inputs)
    job: TraceJob = model._build_job("generate", [invoke], kwargs, False)
    model._run_job(job)
    if job.error is not None:
        raise job.error
    request_ids = job.invocations[-1].request_ids  # the prompts' invocation comes after the edits
    requests = [job.requests[rid] for rid in request_ids]
    return pad_sequences(
        [r.all_token_ids for r in requests],
        [len(r.prompt_token_ids) for r in requests],
        job.pad_token_id,
        job.ids_device,
    )
