"""The server's model: nnrun's LanguageModel with per-request limits and registered edits.

Traces arrive on worker threads (one per HTTP request in flight). Each worker runs its trace as
a local nnrun trace would, through `NNrunTracer.execute`, inside `for_request(limits, prompt_ids)`,
which tells this model's `_run_job` how long the trace may take and whether its client went away,
and `_tokenize` the ids the client computed for its text prompts (`prompt_ids`).
Either ends the trace the way Ctrl-C ends a local one: its requests are aborted (their KV and
mediators freed at the next step boundary) and a block still running is interrupted.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from interleaver.jobs import TraceJob
from interleaver.keywords import _check_kwargs
from interleaver.model import LanguageModel
from interleaver.run_job import run_trace_job
from interleaver.tracer import NNrunTracer, PendingInvoke
from nnrun.engine import RequestHandle
from nnrun.prompts import tokenize_prompt
from nnrun.sampling_params import SamplingParams
from nnrun.serve.block_watch import BlockWatch, EditWatchdog, edit_timeout_message, registration_of
from nnrun.serve.prompt_ids import TokenizerIdentity, checked_ids
from nnrun.serve.registration import Registry, attach_registered, detach_registered
from nnrun.serve.wire import accepted_kwargs

POLL_S = 0.05  # how often a waiting worker looks at its deadline and its client
ABORT_GRACE_S = 10.0  # how long an aborted trace may take to be finalized by the engine
ENGINE_STOP_S = 5.0  # for the engine thread to end at shutdown (the process exits regardless: `drain`)


class ClientGone(ConnectionError):
    """The client that sent this request disconnected; its requests were aborted."""


@dataclass
class RequestLimits:
    """What one HTTP request may use, and the flag its route sets when the client goes away.

    `timeout_s` is wall clock from arrival (queueing included); `block_timeout_s` bounds how long
    one of its blocks may hold the engine thread without parking, which holds every other request
    too: a loop is ended after that, not after the whole request timeout.
    """

    timeout_s: float
    block_timeout_s: float
    edits: list[str] | None = None  # the named registrations this request runs (None: all)
    drain: Any = None  # the server's `Drain`: once it cuts, this request ends with `ServerShuttingDown`
    deadline: float = field(init=False)
    cancelled: threading.Event = field(default_factory=threading.Event)
    registered_saves: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id -> edit -> saves
    request_ids: list[str] = field(default_factory=list)  # the engine requests of its trace, in prompt order

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    def check(self, block_seconds: float) -> None:
        """Raise if the client went away or a limit passed (`block_seconds`: its block's current run)."""
        if self.cancelled.is_set():
            raise ClientGone("the client disconnected; its trace was aborted")
        if self.drain is not None and self.drain.is_cut():
            raise self.drain.error()
        if block_seconds > self.block_timeout_s:
            raise TimeoutError(
                f"the trace's block ran {block_seconds:.1f} s without reaching the model, over this "
                f"server's limit of {self.block_timeout_s:g} s (a loop?); its requests were aborted"
            )
        if time.monotonic() > self.deadline:
            raise TimeoutError(
                f"the trace ran past this server's limit of {self.timeout_s:g} s per request; its requests were aborted"
            )


class ServedLanguageModel(LanguageModel):
    """A LanguageModel serving many clients: limits, cancellation and registered edits per request."""

    def __init__(
        self, model_or_path: Any, *, max_new_tokens: int, block_timeout_s: float = 10.0, **engine_kwargs: Any
    ) -> None:
        super().__init__(model_or_path, **engine_kwargs)
        object.__setattr__(self, "max_new_tokens_limit", max_new_tokens)
        object.__setattr__(self, "registry", Registry())
        # Completions have no worker thread watching their blocks, as a trace has: this one does.
        object.__setattr__(self, "edit_watchdog", EditWatchdog(self.engine, block_timeout_s, self.registry.fail))
        object.__setattr__(self, "_envoys", {envoy.path: envoy for envoy in self.modules()})
        self._envoys[self.path] = self
        object.__setattr__(self, "_request", threading.local())  # this thread's request: .limits, .prompt_ids
        object.__setattr__(self, "_tokenizer_identity", TokenizerIdentity())
        self.tokenizer_fingerprint  # computed now, not on the first request (a large vocabulary takes a while)
        # What a registered block's `tracer` becomes: `tracer.all()`/`iter` act on the running block.
        object.__setattr__(self, "edit_tracer", NNrunTracer(self, "generate"))

    def envoy_at(self, path: str) -> Any:
        """The envoy at an nnsight module path (`model.model.layers.0`), or None."""
        return self._envoys.get(path)

    def stats(self) -> dict[str, Any]:
        """What the engine holds now, its running totals, the edits that failed (a snapshot, for monitoring)."""
        runner = self.engine.runner
        return {
            "requests_in_flight": self.engine.num_requests_in_flight,
            "blocks_live": runner.num_live_blocks(),
            "kv_pages_used": runner.allocator.num_pages - runner.allocator.num_free_pages,
            "edits_installed": len(self.registry.active()),
            "edits_failed": self.registry.failures(),  # taken off the server (an edit that held the engine)
            **self.engine.step_counters(),  # forwards, batched_requests, ...: how well traces share forwards
        }

    def shutdown(self, timeout_s: float = ENGINE_STOP_S) -> bool:
        """Stop the engine (requests still in it fail); a block still running is interrupted, so it cannot hold it."""
        self.edit_watchdog.stop()
        self.engine.runner.interrupt_running_blocks()
        return self.engine.shutdown(timeout_s)

    @property
    def tokenizer_fingerprint(self) -> str | None:
        """What a client's tokenizer must match for the server to take its prompts' ids (`prompt_ids`)."""
        return self._tokenizer_identity.fingerprint(self.tokenizer)

    def checked_kwargs(self, kind: str, kwargs: dict) -> dict:
        """A client's trace keywords, refused as a local trace refuses them."""
        kwargs = {name: value for name, value in kwargs.items() if name != "edits"}
        _check_kwargs(kind, kwargs, accepted_kwargs(kind))
        return kwargs

    @contextmanager
    def for_request(
        self, limits: RequestLimits, prompt_ids: dict[str, list[int]] | None = None
    ) -> Iterator[RequestLimits]:
        """Run this thread's next traces under `limits`, with the client's ids for its text prompts."""
        self._request.limits = limits
        self._request.prompt_ids = prompt_ids
        try:
            yield limits
        finally:
            self._request.limits = self._request.prompt_ids = None

    def submit_completions(
        self, prompts: list[Any], params: list[list[SamplingParams]], stream: bool = False
    ) -> list[RequestHandle]:
        """Queue an OpenAI request's choices: `params[i]` holds one entry per choice of `prompts[i]`.

        Every prompt is checked before any choice runs (a ValueError names the prompt); the choices
        are queued together, in order (prompt, then sample), and registered edits ride each as a
        generation trace.
        """
        for choices in params:
            for choice in choices:
                if choice.max_tokens is None or choice.max_tokens > self.max_new_tokens_limit:
                    raise ValueError(
                        f"max_tokens={choice.max_tokens} is over this server's limit of "
                        f"{self.max_new_tokens_limit} new tokens per request"
                    )
        registrations = self.registry.active()
        requests = []
        for i, (prompt, choices) in enumerate(zip(prompts, params)):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            text, token_ids = tokenize_prompt(prompt, where, self.engine.tokenizer, self.engine.vocab_size)
            for choice in choices:
                # A request carrying blocks is never preempted: a block cannot see its steps twice.
                requests.append(
                    self.engine.make_request_from_ids(
                        list(token_ids),  # its own list: the engine's request keeps it
                        choice,
                        where=where,
                        text=text,
                        request_id=f"cmpl-{uuid.uuid4().hex}",
                        preemptible=not registrations,
                    )
                )
        jobs = [self._attach_registered(req, registrations) for req in requests] if registrations else []
        handles = self.engine.submit_requests(requests, stream=stream)
        # Watched from now: once one finishes, the watchdog forgets it at its next look.
        for req, job in zip(requests, jobs):
            self.edit_watchdog.watch(req, [invocation.mediator for invocation in job.invocations])
        return handles

    def _attach_registered(self, req: Any, registrations: list[Any]) -> TraceJob:
        """A completion's request as a generation trace carrying the registered edits."""
        job = TraceJob("generate", [], pad_token_id=self._pad_token_id())
        job.requests[req.request_id] = req
        attach_registered(job, registrations)
        req.extra_args["nnsight"] = job
        return job

    def abort_completion(self, request_id: str) -> None:
        """End a completion early; a registered edit running on it is interrupted (it would hold the engine)."""
        self.edit_watchdog.abort(request_id)

    # ---- what the tracer asks of the model ------------------------------------------------
    def _sampling_params(self, kind: str, kwargs: dict, prompt_len: int) -> SamplingParams:
        params = super()._sampling_params(kind, kwargs, prompt_len)
        if params.max_tokens is not None and params.max_tokens > self.max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens={params.max_tokens} is over this server's limit of "
                f"{self.max_new_tokens_limit} new tokens per request"
            )
        return params

    def _tokenize(self, prompt: Any, where: str) -> list[int]:
        """A text prompt's ids as the client computed them with this same tokenizer, else tokenized here."""
        prompt_ids = getattr(self._request, "prompt_ids", None)
        if prompt_ids and isinstance(prompt, str):
            ids = checked_ids(prompt_ids.get(prompt), self.engine.vocab_size)
            if ids is not None:
                return list(ids)  # its own list: the engine's request keeps it
        return super()._tokenize(prompt, where)

    def _build_job(self, kind: str, invokes: list[PendingInvoke], trace_kwargs: dict, needs_grad: bool) -> TraceJob:
        job = super()._build_job(kind, invokes, trace_kwargs, needs_grad)
        limits = getattr(self._request, "limits", None)
        registrations = self.registry.active(limits.edits if limits is not None else None)
        if registrations:
            attach_registered(job, registrations)
        return job

    def _run_job(self, job: TraceJob) -> None:
        """Run the trace; end it early if a limit passes or its client goes away."""
        limits = getattr(self._request, "limits", None)
        if limits is None:
            super()._run_job(job)
            detach_registered(job)
            return
        limits.request_ids = list(job.requests)
        self._ship_to_ranks(job)
        watch = BlockWatch(self.engine.runner, [inv.mediator for inv in job.invocations])
        try:
            run_trace_job(
                self.engine,
                job,
                check=lambda: self._check_limits(limits, watch),
                poll_s=POLL_S,
                abort_grace_s=ABORT_GRACE_S,
                abort_with_error=True,
            )
        finally:
            if job.done.is_set():
                limits.registered_saves = detach_registered(job)

    def _check_limits(self, limits: RequestLimits, watch: BlockWatch) -> None:
        """`limits.check`; a registered edit that held the engine too long is also taken off the server."""
        seconds = watch.seconds_running()
        registration = registration_of(watch.running)
        if registration is not None and seconds > limits.block_timeout_s:
            message = edit_timeout_message(registration, seconds, limits.block_timeout_s)
            self.registry.fail(registration, message)
            raise TimeoutError(message)
        limits.check(seconds)
