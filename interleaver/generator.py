"""`model.generator`: a generation's token ids, and its streamer's calls, served as nnsight serves them on HF.

nnsight's TransformersModel passes `generate`'s output through a `Generator` module
(`model.generator.output`: the whole batch of ids, `[B, T_max + new]`, left-padded) and hands
`generate` that module's `streamer`, which HF's decode loop calls with the prompt ids (`[B, T_max]`)
before the first forward and with each step's tokens (`[B]`) after it samples them: each call is a
visit of `model.generator.streamer.output`, so `tracer.iter[s]` reads the s-th call. A trace's batch
is all its prompts, so an invoke reads its own rows of matrices padded to the whole trace.

nnrun's runner makes these visits itself, one block at a time, since each block's rows are padded
to its own trace, which the step's other traces know nothing of:

- `serve_prompts`: a block's prompt rows once it has started, before its first forward;
- `serve_step_tokens`: its rows of the step's tokens, after `model.samples`;
- `serve_generated_ids`: its rows of the ids (`requests.padded_generated_ids`) once every request of its
  trace has finished, before `tracer.result`; an assignment there changes the result, as on HF.

A visit counts for the served block alone (`_serve`), so other traces' steps never shift its
occurrences. A trace with no generation (`trace`) never reaches these locations, as on HF, and a
generation given a user's streamer feeds that one instead of `model.generator.streamer`, as
nnsight's `generate(streamer=...)` does (interleaver/streaming.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from nnsight.modeling.transformers import Generator, GeneratorEnvoy

from nnrun.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from interleaver.jobs import Invocation, TraceJob
    from interleaver.mediator import PackedMediator

GENERATOR_OUTPUT = "model.generator.output"
NOT_SERVED = object()  # `serve_generated_ids` for a block that was not waiting for the ids
STREAMER_OUTPUT = "model.generator.streamer.output"


def add_generator(model: Any) -> None:
    """Give a client tree nnsight's `model.generator` (and `model.generator.streamer`)."""
    generator = GeneratorEnvoy(Generator(), path=f"{model.path}.generator", interleaver=model.interleaver, parent=model)
    object.__setattr__(model, "generator", generator)
    model._children.append(generator)


def user_streamer(kind: str, kwargs: dict) -> Any:
    """The streamer a generation feeds instead of nnsight's (a trace is one forward: it streams nothing, as on HF)."""
    return kwargs.get("streamer") if kind == "generate" else None


def _streams_to_generator(job: "TraceJob") -> bool:
    return job.kind == "generate" and job.streamer is None


# ---- runner side (engine thread) ------------------------------------------------------------
def serve_prompts(invocations: list["Invocation"]) -> bool:
    """The first visit of the streamer, for blocks that just started: their prompt rows. True if any was served."""
    served = False
    widths: dict[int, int] = {}  # per job, its longest prompt (each block's rows are padded to its trace)
    for invocation in invocations:
        if invocation.has_streamed_prompt or not _streams_to_generator(invocation.job):
            continue
        invocation.has_streamed_prompt = True
        mediator = invocation.mediator
        if not mediator.is_waiting_for(STREAMER_OUTPUT):  # the visit only counts: no rows to build
            _count_visit(mediator, STREAMER_OUTPUT)
            continue
        _serve(mediator, STREAMER_OUTPUT, _prompt_rows(invocation, widths))
        served = True
    return served


def serve_step_tokens(invocations: list["Invocation"], forward_batch: ForwardBatch, token_ids: torch.Tensor) -> None:
    """A step's visit of the streamer: each block's rows of the tokens sampled (a finished request's: HF's pad)."""
    row_of: dict[str, int] | None = None
    sampled: list[int] = []
    for invocation in invocations:
        job = invocation.job
        if not _streams_to_generator(job):
            continue
        mediator = invocation.mediator
        if not mediator.is_waiting_for(STREAMER_OUTPUT):  # the visit only counts: no rows to build
            _count_visit(mediator, STREAMER_OUTPUT)
            continue
        if row_of is None:
            row_of = {req.request_id: row for row, req in enumerate(forward_batch.reqs)}
            sampled = token_ids.tolist()
        tokens = [sampled[row_of[rid]] if rid in row_of else job.pad_token_id for rid in invocation.request_ids]
        _serve(mediator, STREAMER_OUTPUT, torch.tensor(tokens, dtype=torch.int64))  # [k]


def serve_generated_ids(invocation: "Invocation", make_ids: Callable[[], torch.Tensor]) -> Any:
    """`model.generator.output` at the end of a generation: the block's rows of the trace's ids.

    Returns them, replaced if the block assigned them: on HF `tracer.result` is the generator's output.
    A block not waiting for them only has the visit counted, and gets `NOT_SERVED` back (no ids built).
    """
    mediator = invocation.mediator
    if not mediator.is_waiting_for(GENERATOR_OUTPUT):
        _count_visit(mediator, GENERATOR_OUTPUT)
        return NOT_SERVED
    return _serve(mediator, GENERATOR_OUTPUT, make_ids())


def _prompt_rows(invocation: "Invocation", widths: dict[int, int]) -> torch.Tensor:
    job = invocation.job
    if id(job) not in widths:
        widths[id(job)] = max(len(req.prompt_token_ids) for req in job.requests.values())
    width = widths[id(job)]
    rows = []
    for request_id in invocation.request_ids:
        prompt = list(job.requests[request_id].prompt_token_ids)
        rows.append([job.pad_token_id] * (width - len(prompt)) + prompt)
    return torch.tensor(rows, dtype=torch.int64)  # [k, T_max]


def _serve(mediator: "PackedMediator", location: str, value: Any) -> Any:
    """One visit of `location` for this block alone; returns the value, replaced if the block assigned it.

    The value is already the block's own rows, so it is served whole (no batch group). The visit is
    counted on the block, not the interleaver: its next read of `location` asks for the next visit.
    """
    group, mediator.batch_group = mediator.batch_group, None
    try:
        value = mediator.handle(location, value)
    except Exception as error:  # deferred as the interleaver defers a block's error: it ends this block only
        mediator.exception = error
        mediator.pending = None
    finally:
        mediator.batch_group = group
    _count_visit(mediator, location)
    return value


def _count_visit(mediator: "PackedMediator", location: str) -> None:
    """Count a visit of `location` on the block alone: its next read of it asks for the next visit."""
    mediator.counts_at_start[location] = mediator.counts_at_start.get(location, 0) - 1
