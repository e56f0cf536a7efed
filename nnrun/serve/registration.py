"""Registered edits: blocks installed on the server that run for every request it serves.

`POST /v1/nnsight/register/{id}` carries what nnsight's `model.edit(serve=url)` sends: a pickled
`Mediator` whose state is the block's source and the names it reads. The server keeps it as a
template; every request it admits afterwards (a trace's prompts, an OpenAI completion) gets a
fresh copy with a scope of its own, run before the trace's own blocks, so a trace reads what
the edit left behind. What a copy saves comes back on that request's output, never in the
trace's own variables. `?name=` installs it under a name; a trace may then choose its edits with
`edits=[...]` (unnamed edits always run).
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from nnsight.intervention.interleaver import Mediator

from interleaver.jobs import Invocation, TraceJob
from interleaver.mediator import PackedMediator
from nnrun.serve.payload import PayloadError, ServerObjects, load_block

MAX_KEPT_FAILURES = 64  # failed edits remembered for /health and their registrants


@dataclass(frozen=True)
class Registration:
    """One installed block: its compiled code and the scope every copy starts from."""

    id: str
    name: str | None
    code: Any
    glbls: dict
    lcls: dict

    def copy(self) -> PackedMediator:
        """A fresh mediator for one request: its own scope, so its saves are that request's."""
        mediator = PackedMediator(self.code, self.glbls, dict(self.lcls))
        mediator.registration = self  # who to blame if it holds the engine (`block_watch`)
        return mediator


class Registry:
    """The edits installed on this server (thread-safe), and the ones it took off because they failed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registrations: dict[str, Registration] = {}
        self._failures: OrderedDict[str, dict[str, Any]] = OrderedDict()  # id -> {"id", "name", "error"}

    def register(self, registration_id: str, payload: bytes, name: str | None, model: Any) -> Registration:
        """Install (or replace) the block in `payload` under `registration_id`."""
        if getattr(model.engine.runner, "ships_jobs", False):
            raise PayloadError(
                "registered edits are not served on tensor-parallel ranks yet (a registration rides every "
                "request, and this server's blocks run on its ranks); run `nnrun serve` with --tensor-parallel-size 1"
            )
        try:
            template = ServerObjects(io.BytesIO(payload), model).load()
        except PayloadError:
            raise
        except Exception as error:
            raise PayloadError(
                f"the request body is not a serialized nnsight edit ({type(error).__name__}: {error})"
            ) from None
        if not isinstance(template, Mediator):
            raise PayloadError("the request body is not a serialized nnsight edit (expected a Mediator)")
        glbls = load_block(dict(template.glbls), model, model.edit_tracer)
        glbls.setdefault("__builtins__", __builtins__)
        lcls = load_block(dict(template.lcls), model, model.edit_tracer)
        registration = Registration(registration_id, name, template.code, glbls, lcls)
        with self._lock:
            self._registrations[registration_id] = registration
        return registration

    def clear(self, registration_id: str | None = None) -> list[str]:
        """Remove one registration (unknown ids are a no-op) or, with None, all; returns the ids removed."""
        with self._lock:
            ids = list(self._registrations) if registration_id is None else [registration_id]
            return [rid for rid in ids if self._registrations.pop(rid, None) is not None]

    def fail(self, registration: Registration, error: str) -> None:
        """Take an edit off the server because it held the engine; its registrant can read why (`status`)."""
        with self._lock:
            if self._registrations.get(registration.id) is registration:
                del self._registrations[registration.id]
            self._failures[registration.id] = {"id": registration.id, "name": registration.name, "error": error}
            while len(self._failures) > MAX_KEPT_FAILURES:
                self._failures.popitem(last=False)

    def status(self, registration_id: str) -> dict[str, Any]:
        """`{"status": "active" | "failed" | "unknown", "error": ...}` for one registration id."""
        with self._lock:
            if registration_id in self._registrations:
                return {"id": registration_id, "status": "active", "error": None}
            failure = self._failures.get(registration_id)
        if failure is not None:
            return {**failure, "status": "failed"}
        return {"id": registration_id, "status": "unknown", "error": None}

    def failures(self) -> list[dict[str, Any]]:
        """The edits taken off because they failed, oldest first (the last `MAX_KEPT_FAILURES`)."""
        with self._lock:
            return list(self._failures.values())

    def active(self, wanted: list[str] | None = None) -> list[Registration]:
        """The registrations a request runs: all, or the named ones in `wanted` plus every unnamed one."""
        with self._lock:
            registrations = list(self._registrations.values())
        if wanted is None:
            return registrations
        installed = {r.name for r in registrations if r.name is not None}
        unknown = [name for name in wanted if name not in installed]
        if unknown:
            raise ValueError(
                f"edits={wanted!r} names {unknown!r}, but no edit is installed under that name "
                f"(installed: {sorted(installed)!r})"
            )
        return [r for r in registrations if r.name is None or r.name in wanted]


def attach_registered(job: TraceJob, registrations: list[Registration]) -> None:
    """Give every request of `job` its own copy of each registration, served before the trace's blocks."""
    pairs = [
        (Invocation(registration.copy(), [request_id], index=-1, job=job), registration)
        for request_id in job.requests
        for registration in registrations
    ]
    job.registered = pairs  # the serve layer's own note on the job, read back by `detach_registered`
    job.invocations = [invocation for invocation, _ in pairs] + job.invocations


def detach_registered(job: TraceJob) -> dict[str, dict[str, Any]]:
    """Take the registered copies off a finished job; return request id -> {registration id: its saves}."""
    registered = getattr(job, "registered", [])
    copies = {id(invocation) for invocation, _ in registered}
    job.invocations = [inv for inv in job.invocations if id(inv) not in copies]
    saves: dict[str, dict[str, Any]] = {}
    for invocation, registration in registered:
        if invocation.saves:
            saves.setdefault(invocation.request_ids[0], {})[registration.name or registration.id] = invocation.saves
    return saves
