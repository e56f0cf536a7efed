"""The serve client: `nnrun.LanguageModel(name, serve=url)` runs its traces on an `nnrun serve` engine.

`RemoteLanguageModel` builds the model's module tree on the meta device (a config, no weights),
so `model.model.layers[0].output` and the rest of the nnsight API read as they do locally. A
trace is captured as usual, serialized as nnsight's `RequestModel.serialize` does (the block as
source, plus the names it reads; each envoy travels as `Envoy:<path>`, resolved to the server's),
posted to `/v1/nnsight/generate`, and its saves are pushed into the caller's frame as a local
trace pushes them. An error in the block is re-raised here with its own type. `blocking=False`
sends the trace in the background and returns at once; `tracer.collect()` waits for it, pushes
its saves and returns them.
"""

from __future__ import annotations

import ast
import json
import os
import threading
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

import torch

from nnsight import NNsight
from nnsight.intervention.interleaver import Mediator
from nnsight.intervention.serialization import dumps
from nnsight.intervention.tracer import InterleavingTracer
from nnsight.tracing.backend import Backend
from nnsight.tracing.tracer import Tracer, WithBlockNotFoundError, mark, skip_context, skippable
from nnsight.tracing.util import SerializedFrame, push

from interleaver.keywords import _check_kwargs
from interleaver.mediator import ServedValues
from nnrun.serve import wire
from nnrun.serve.block_payload import serialize_trace
from nnrun.serve.prompt_ids import PROMPT_IDS_ATTRIBUTE, TokenizerIdentity, encode_trace_prompts
from nnrun.serve.transport import MAX_RETRIES, RETRY_TIMEOUT_S, Connection

MAX_BACKGROUND_TRACES = 16  # non-blocking traces one model sends at once (more wait their turn)


class RemoteLanguageModel(ServedValues, NNsight):
    """nnsight's LanguageModel API over an `nnrun serve` engine: a meta tree here, the weights there.

    `RemoteLanguageModel(model, serve=url, api_key=None, tokenizer=None, max_retries=4, retry_timeout=60)`:
    `model` is what the server was started with (a checkpoint folder, hub id or bundled name), read
    here for its config only. A request the server refuses with 429 or 503 (busy, or restarting) is
    sent again after its Retry-After, at most `max_retries` times within `retry_timeout` seconds.
    Engine options a local model would take (`device`, `dtype`, `max_num_seqs`, ...) are accepted
    and ignored, so local code runs against a server by adding `serve=`: the server's own apply.
    """

    def __init__(
        self,
        model_or_path: Any,
        *,
        serve: str,
        api_key: str | None = None,
        tokenizer: Any = None,
        trust_remote_code: bool = False,
        max_retries: int = MAX_RETRIES,
        retry_timeout: float = RETRY_TIMEOUT_S,
        **engine_kwargs: Any,
    ) -> None:
        path = _resolve_path(model_or_path)
        super().__init__(_meta_model(path, trust_remote_code))
        for envoy in [self, *self.modules()]:
            envoy.__dict__["_persistent_id"] = f"Envoy:{envoy.path}"  # the server resolves it to its own envoy
        object.__setattr__(self, "url", serve.rstrip("/"))
        object.__setattr__(self, "api_key", api_key)
        object.__setattr__(self, "tokenizer", tokenizer if tokenizer is not None else _tokenizer(path))
        object.__setattr__(self, "_tokenizer_identity", TokenizerIdentity())
        object.__setattr__(self, "_http", Connection(self.url, api_key, max_retries, retry_timeout))
        object.__setattr__(self, "_background", None)
        object.__setattr__(self, "_background_lock", threading.Lock())

    @property
    def tokenizer_fingerprint(self) -> str | None:
        """This tokenizer's fingerprint: a trace's text prompts are tokenized here and sent with it, and the
        server takes the ids only if its own tokenizer's fingerprint is the same (`nnrun.serve.prompt_ids`)."""
        return self._tokenizer_identity.fingerprint(self.tokenizer)

    # ---- tracing --------------------------------------------------------------------------
    def trace(
        self, *inputs: Any, blocking: bool = True, edits: list[str] | None = None, **kwargs: Any
    ) -> "RemoteTracer":
        """`with model.trace(prompt):` run on the server; `blocking=False` returns at once (see `collect`)."""
        _check_kwargs("trace", kwargs, wire.accepted_kwargs("trace"))
        return RemoteTracer(self, "trace", *inputs, backend=ServeBackend(self, blocking, edits), **kwargs)

    def generate(self, *inputs: Any, blocking: bool = True, edits: list[str] | None = None, **kwargs: Any) -> Any:
        """`with model.generate(prompt, max_new_tokens=...)`; called plainly, returns the token ids."""
        _check_kwargs("generate", kwargs, wire.accepted_kwargs("generate"))
        tracer = RemoteTracer(self, "generate", *inputs, backend=ServeBackend(self, blocking, edits), **kwargs)
        try:
            tracer.capture()
        except WithBlockNotFoundError:
            return self._generate_plain(tracer)
        return tracer

    def register(self, name: str | None = None) -> "RegisteringTracer":
        """`with model.register() as (tracer, edit):` install the block on the server, for every request.

        nnsight's `model.edit(serve=url)` for vLLM: the block runs on each request the server
        serves from now on (traces and OpenAI completions alike) until `edit.clear()`.
        """
        return RegisteringTracer(self, name)

    def clear_edits(self) -> None:
        """Remove every edit installed on the server (by anyone)."""
        self._post("/v1/nnsight/clear", b"")

    def shutdown(self) -> None:
        """Close this client's connections (the server keeps running)."""
        if self._background is not None:
            self._background.shutdown(wait=True)
        self._http.close()

    def _generate_plain(self, tracer: "RemoteTracer") -> torch.Tensor:
        """Token ids of a plain `model.generate(...)`: a trace whose block saves `tracer.result`."""
        tracer.node = ast.parse("with tracer:\n    __nnrun_ids__ = tracer.result.save()\n").body[0]
        frame = SerializedFrame("<nnrun generate>", 1, "<module>")
        frame.f_locals = {"tracer": tracer}
        tracer.info = Tracer.Info(frame, None)
        return tracer.backend.send(tracer)["__nnrun_ids__"]

    # ---- transport ------------------------------------------------------------------------
    def _post(self, path: str, content: bytes, params: Any = None) -> bytes:
        """POST to the server; the answer's body. Any transport failure or non-200 answer is a ConnectionError."""
        return self._http.post(path, content, params)

    def _submit(self, fn: Any, *args: Any) -> Future:
        with self._background_lock:
            if self._background is None:
                object.__setattr__(
                    self,
                    "_background",
                    ThreadPoolExecutor(max_workers=MAX_BACKGROUND_TRACES, thread_name_prefix="nnrun-serve-client"),
                )
        return self._background.submit(fn, *args)


class RemoteTracer(InterleavingTracer):
    """A trace whose block runs on the server; `collect()` finishes a non-blocking one."""

    def collect(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for a `blocking=False` trace: push its saves into the trace's frame, and return them."""
        return self.backend.collect(timeout)

    @property
    def edit_saves(self) -> list[dict[str, Any]]:
        """What the server's registered edits saved on this trace: per prompt, {edit name or id: {name: value}}."""
        return self.backend.registered


class ServeBackend(Backend):
    """Send a captured trace to the server and bring its saves home."""

    def __init__(self, model: RemoteLanguageModel, blocking: bool = True, edits: list[str] | None = None) -> None:
        self.model = model
        self.blocking = blocking
        self.edits = edits
        self.future: Future | None = None
        self.frame: Any = None
        self.registered: list[dict[str, Any]] = []  # per prompt: what each registered edit saved

    def __call__(self, tracer: Tracer) -> None:
        if self.blocking:
            push_saves(tracer.info.frame, self.send(tracer))
            return
        blob = self._payload(tracer)  # now: the frame's values as they are now
        self.frame = tracer.info.frame
        self.future = self.model._submit(self._exchange, blob)

    def send(self, tracer: Tracer) -> dict[str, Any]:
        """Run the trace on the server; its saves (its error raised here)."""
        return self._exchange(self._payload(tracer))

    def _payload(self, tracer: Tracer) -> bytes:
        """The trace serialized, with the ids of its text prompts (the server's CPU is everyone's)."""
        model = self.model
        encoded = encode_trace_prompts(model.tokenizer, model.tokenizer_fingerprint, tuple(getattr(tracer, "args", ())))
        if encoded is not None:
            tracer.__dict__[PROMPT_IDS_ATTRIBUTE] = encoded
        return serialize_trace(tracer)

    def collect(self, timeout: float | None = None) -> dict[str, Any]:
        if self.future is None:
            raise RuntimeError("collect() is for a trace sent with blocking=False, after its `with` block")
        saves = self.future.result(timeout)
        if self.frame is not None:
            push_saves(self.frame, saves)
            self.frame = None  # the frame holds the tracer, which holds this backend
        return saves

    def _exchange(self, blob: bytes) -> dict[str, Any]:
        params = [("edits", name) for name in self.edits] if self.edits else None
        result = wire.decode_result(self.model._post("/v1/nnsight/generate", blob, params))
        self.registered = result.get("registered", [])
        wire.raise_remote_error(result.get("error"))
        return result.get("saves", {})


def push_saves(frame: Any, saves: dict[str, Any]) -> None:
    """Write returned saves into the trace's frame, as a local trace's push does."""
    for value in saves.values():
        mark(value)  # the trace scope's push keeps only marked values
    if frame is not None:
        push(frame, saves)


class EditRegistration:
    """A block installed on the server; `clear()` takes it off."""

    def __init__(self, model: RemoteLanguageModel, registration_id: str, name: str | None) -> None:
        self.model = model
        self.id = registration_id
        self.name = name
        self.cleared = False

    def status(self) -> dict[str, Any]:
        """The server's word on this edit: `{"status": "active" | "failed" | "unknown", "error": ...}`.

        An edit that held the engine past the server's block timeout is taken off the server: its
        status is then "failed", and "error" says what it did.
        """
        return json.loads(self.model._http.post(f"/v1/nnsight/register/{quote(self.id, safe='')}", b"", method="GET"))

    @property
    def error(self) -> str | None:
        """Why the server took this edit off (None while it runs, or after `clear()`)."""
        return self.status()["error"]

    def clear(self) -> None:
        """Take the edit off the server; warns if the server had already taken it off (and says why)."""
        if not self.cleared:
            answer = json.loads(self.model._post(f"/v1/nnsight/register/{quote(self.id, safe='')}/clear", b""))
            self.cleared = True
            if answer.get("error"):
                warnings.warn(
                    f"the server had already taken this edit off: {answer['error']}", RuntimeWarning, stacklevel=2
                )

    def __repr__(self) -> str:
        state = "cleared" if self.cleared else "active"
        return f"<EditRegistration {self.name or self.id} on {self.model.url} ({state})>"


class RegisteringTracer(Tracer):
    """Capture a block and install it on the server (nnsight's wire format: a pickled `Mediator`)."""

    def __init__(self, model: RemoteLanguageModel, name: str | None) -> None:
        super().__init__()
        self.model = model
        self.registration = EditRegistration(model, f"registration-{uuid.uuid4().hex}", name)
        self.__dict__["_persistent_id"] = "Tracer"  # the block's `tracer` is the server's

    def __enter__(self) -> tuple["RegisteringTracer", EditRegistration]:
        self.capture()  # called here, not via super().__enter__: capture reads the caller's frame by depth
        if skippable(self.node):
            skip_context(self)
        return self, self.registration

    def execute(self, code: Any) -> None:
        frame = self.info.frame
        template = Mediator(code, frame.f_globals, dict(frame.f_locals), node=self.node)
        path = f"/v1/nnsight/register/{quote(self.registration.id, safe='')}"
        params = {"name": self.registration.name} if self.registration.name is not None else None
        self.model._post(path, dumps(template), params)


def _resolve_path(model_or_path: Any) -> str:
    source = str(model_or_path)
    if os.path.isdir(source):
        return source
    from nnrun.assets import bundled_model_path, is_bundled_model

    return str(bundled_model_path(source)) if is_bundled_model(source) else source


def _meta_model(path: str, trust_remote_code: bool) -> torch.nn.Module:
    """The model's module tree with every parameter on the meta device: shapes and paths, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code).eval()


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None
