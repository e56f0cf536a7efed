"""The client side of a trace: collect its invokes, hand them to the engine, bring the saves home.

`NNrunTracer` keeps nnsight's capture, scoping and save rules (it is an `InterleavingTracer`) and
replaces only what running means: instead of calling the model, `execute` turns each invoke into
a mediator over one engine request per prompt, submits them, waits on the engine thread to run
and finish them, then marks each returned save on this thread and pushes it into the caller's
frame. Saves are pushed even when a block raised, so the other invokes keep theirs; the first
real error is raised after that, with the user's line in its traceback.
"""

from __future__ import annotations

import ast
import os
import warnings
from dataclasses import dataclass, field
from types import CodeType
from typing import TYPE_CHECKING, Any

from nnsight.intervention.interleaver import Mediator, OutOfOrderError
from nnsight.intervention.tracer import InterleavingTracer, Invoker
from nnsight.intervention.util import clear_shared_locals, shared_locals
from nnsight.tracing.tracer import mark, push_result
from nnsight.tracing.util import Scope, filter_traceback

from interleaver.layouts import SAMPLES_LOCATION
from interleaver.mediator import PackedMediator
from interleaver.nnsight_private import saved_value_ids
from nnrun.exact import family_of

if TYPE_CHECKING:
    from interleaver.jobs import TraceJob

_PACKAGE_DIR = os.path.dirname(__file__)


@dataclass
class PendingInvoke:
    """An invoke collected from a trace body, before it becomes engine requests."""

    mediator: PackedMediator
    inputs: tuple
    kwargs: dict = field(default_factory=dict)
    prompts: list[list[int]] | None = None  # the inputs as token ids, once checked


class NNrunInvoker(Invoker):
    """`tracer.invoke(...)`: records its body as a mediator on the trace (not on the model)."""

    def execute(self, code: CodeType) -> None:
        # Checked here, so a bad input's traceback ends at this invoke's line, not the trace's.
        prompts = self.tracer.invoke_prompts(self.args, self.kwargs)
        frame = self.info.frame
        mediator = PackedMediator(
            code, frame.f_globals, dict(frame.f_locals), node=self.node, shared=shared_locals(frame)
        )
        self.tracer.pending_invokes.append(PendingInvoke(mediator, self.args, self.kwargs, prompts))


class NNrunTracer(InterleavingTracer):
    """`model.trace(...)` / `model.generate(...)` on nnrun: the invokes run as engine requests."""

    def __init__(self, envoy: Any, fn: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(envoy, fn, *args, **kwargs)
        self.pending_invokes: list[PendingInvoke] = []
        # An invoke's text prompt -> its token ids, for this trace: a sweep invokes the same prompt
        # many times, and nnsight on HF tokenizes a trace's invokes together, once, after the body.
        self.tokenized: dict[str, list[list[int]]] = {}

    def invoke(self, *args: Any, **kwargs: Any) -> NNrunInvoker:
        return NNrunInvoker(self, *args, **kwargs)

    def barrier(self, n: int) -> Any:
        """nnsight's barrier; refused where each prompt has its own forward (nnrun's exact path)."""
        engine = getattr(self.envoy, "engine", None)
        if engine is not None and not engine.runner.path.packs_requests:
            raise ValueError(
                f"tracer.barrier() makes invokes meet inside one forward, but {family_of(engine.model)} runs on "
                "nnrun's exact path, where each prompt has its own forward; share values without a barrier (a later "
                "invoke can read what an earlier one saved)"
            )
        return super().barrier(n)

    def invoke_prompts(self, args: tuple, kwargs: dict) -> list[list[int]]:
        """An invoke's prompts as token ids (checked), tokenizing a text prompt once per trace."""
        text = args[0] if len(args) == 1 and type(args[0]) is str and not kwargs else None
        if text is None:
            return self.envoy._invoke_prompts(self.fn, args, kwargs)
        if text not in self.tokenized:
            self.tokenized[text] = self.envoy._invoke_prompts(self.fn, args, kwargs)
        return [list(prompt) for prompt in self.tokenized[text]]  # each request owns its ids

    def next(self, step: int = 1) -> None:
        """Bind the block's following reads to the generation step `step` after the current one.

        The step a block is running in is how many times `model.samples` has been served since it
        started (samples close each step); the pin relaxes after its first hit, as `tracer.iter`'s.
        """
        mediator = Mediator.current("tracer.next()")
        current = mediator.iteration if mediator.iteration else mediator.occurrence(SAMPLES_LOCATION)
        mediator.iteration = current + step

    def execute(self, code: CodeType) -> None:
        frame = self.info.frame
        job: TraceJob | None = None
        client_saves: list[Any] = []
        try:
            if self.envoy._batch_size(*self.args):
                mediator = PackedMediator(code, frame.f_globals, dict(frame.f_locals), node=self.node)
                self.pending_invokes.append(PendingInvoke(mediator, self.args))
            else:
                body = Scope(dict(frame.f_locals), shared_locals(frame), frame.f_globals)
                exec(code, body)
                push_result(frame, body.writes())
                if not self.pending_invokes:
                    raise ValueError("trace() needs an input, or at least one `with tracer.invoke(...)` block")
                client_saves = [value for value in body.writes().values() if id(value) in saved_value_ids()]
            job = self.envoy._build_job(self.fn, self.pending_invokes, self.kwargs, _asks_for_grad(self.node))
            job.client_saves = client_saves
            self.envoy._run_job(job)
        finally:
            if job is not None and job.done.is_set():  # an interrupted trace was aborted: nothing to push
                _push_saves(frame, job)
            self.pending_invokes = []
            clear_shared_locals()
        error = job.error
        if error is not None:
            error = _explain_result_order(job, error, frame.f_code.co_filename)
            raise error.with_traceback(_user_traceback(error))


def _push_saves(frame: Any, job: "TraceJob") -> None:
    for invocation in job.invocations:
        if invocation.warning is not None:
            warnings.warn(invocation.warning, stacklevel=4)
        if invocation.is_edit:  # a stored edit's names stay its own, as on HF
            continue
        for value in invocation.saves.values():
            mark(value)  # saved on the engine thread; this thread's save set decides what is pushed
        # The outermost trace pushes only what was saved; one inside a session pushes every name.
        push_result(frame, invocation.mediator.lcls.writes())


RESULT_ORDER_HINT = """`tracer.result` was read above this line, in the same block: the result exists only after the model's
last step, so nothing after it in that block can read a module. Read it last: after a loop of fixed length
(`for step in tracer.iter[:n]` with `max_new_tokens=n, min_new_tokens=n`), or in a later invoke:

    with model.generate(max_new_tokens=3) as tracer:
        with tracer.invoke(prompt):
            hidden = list().save()
            for step in tracer.all():
                hidden.append(model.model.layers[1].output)
        with tracer.invoke():  # runs after the first block has left the model
            result = tracer.result.save()"""


def _explain_result_order(job: "TraceJob", error: BaseException, filename: str) -> BaseException:
    """An out-of-order read in a block that read `tracer.result` above it: say why and show what works."""
    if not isinstance(error, OutOfOrderError):
        return error
    line = None  # the line of the block (in the trace's file) that made the read
    traceback = _user_traceback(error)
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == filename:
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    if line is None or not any(_reads_result_before(invocation.mediator.node, line) for invocation in job.invocations):
        return error
    explained = OutOfOrderError(f"{error}\n{RESULT_ORDER_HINT}")
    explained.__intervention_tb__ = getattr(error, "__intervention_tb__", None) or error.__traceback__
    return explained


def _reads_result_before(node: ast.AST | None, line: int) -> bool:
    """Whether a block reads `<tracer>.result` on a line before `line` (and `line` is inside the block)."""
    if node is None or not (node.lineno <= line <= getattr(node, "end_lineno", line)):
        return False
    return any(isinstance(n, ast.Attribute) and n.attr == "result" and n.lineno < line for n in ast.walk(node))


def _user_traceback(error: BaseException) -> Any:
    """The block's own traceback (where the worker raised), without this package's frames."""
    traceback = getattr(error, "__intervention_tb__", None) or error.__traceback__
    return filter_traceback(traceback, lambda frame: not frame.f_code.co_filename.startswith(_PACKAGE_DIR))


def _asks_for_grad(node: ast.AST | None) -> bool:
    """Whether a block reads `.grad`, retains one or calls `.backward()`: its requests run with autograd on.

    (`retain_grad()` alone counts: the gradient may be taken after the trace, from a saved output.)
    nnsight parses a `with` block once per call site and hands back the same node on every trace
    there, so the answer is kept on the node.
    """
    if node is None:
        return False
    asks = getattr(node, "_nnrun_asks_for_grad", None)
    if asks is None:
        asks = any(
            isinstance(n, ast.Attribute) and n.attr in ("grad", "backward", "retain_grad") for n in ast.walk(node)
        )
        node._nnrun_asks_for_grad = asks
    return asks
