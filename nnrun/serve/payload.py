"""A serialized nnsight trace, rebuilt on the server over the server's own model tree.

A client sends `RequestModel.serialize(tracer)`: a pickle of its tracer (the model call: kind,
prompts, keywords) and of the block as source plus the names it reads. Modules travel as
persistent ids (`Module:<path>`), so the payload carries no weights. nnsight's own client (a
`LanguageModel` on the meta device) pickles its envoys by value; nnrun's client tags each envoy
as `Envoy:<path>`. Either way the block must end up reading the server's envoys and calling the
server's tracer, so after unpickling every envoy and the client's tracer found in the block's
scope are swapped for the server's (`_Rebinder`).

A block is compiled under a filename of its own source: nnsight caches a block's source and
parsed `with` nodes by filename and line (`SOURCES`, `BLOCKS`) and never re-reads them, so two
clients' `client.py` holding different blocks would otherwise run each other's invokes. Traces
of the same block (a client's loop) share one compiled block (`_BlockCache`): the server parses,
compiles and walks it once, not per request, and nnsight's caches hit for its inner invokes.
"""

from __future__ import annotations

import ast
import io
import itertools
import linecache
import threading
from collections import OrderedDict
from typing import Any

import torch

from nnsight.intervention.envoy import Envoy
from nnsight.intervention.serialization import CustomCloudUnpickler
from nnsight.tracing.globals import BLOCKS, SOURCES
from nnsight.tracing.tracer import Tracer
from nnsight.tracing.util import SerializedFrame

from interleaver.tracer import NNrunTracer
from nnrun.serve.prompt_ids import PROMPT_IDS_ATTRIBUTE, accepted_prompt_ids

# nnsight's `fn` for a trace (a bound `_call`, or the name of the call) and for a generation.
_TRACE_FNS = {"trace", "_call", "__call__", "forward"}
_GENERATE_FNS = {"generate"}
BLOCK_CACHE_SIZE = 256  # distinct blocks kept compiled while no request uses them


class PayloadError(ValueError):
    """The request body is not a trace this server can run (garbage, or another model's tree)."""


class ServerObjects(CustomCloudUnpickler):
    """Resolves the payload's persistent ids against the server's model.

    A module path the server's tree lacks (nnsight's `generator` wrapper, say) resolves to an
    empty module, so the payload still loads; only a block that uses it fails, at its own line.
    """

    def __init__(self, file: io.BufferedIOBase, model: Any) -> None:
        super().__init__(file, None)
        self.model = model

    def persistent_load(self, pid: Any) -> Any:
        model = self.model
        if not isinstance(pid, str):
            raise PayloadError(f"unknown persistent id {pid!r} in the trace payload")
        kind, _, path = pid.partition(":")
        if kind == "Envoy":
            return model.envoy_at(path) or _missing_envoy(path)
        if kind == "Module":
            envoy = model.envoy_at(path)
            return envoy._module if envoy is not None else torch.nn.Module()
        if pid == "Interleaver":
            return model.interleaver
        if pid == "Tracer":  # a registered block's tracer (nnrun's client tags it)
            return model.edit_tracer
        if pid == "Tokenizer":
            return model.tokenizer
        return None  # a pipeline or processor of nnsight's HF wrapper: unused on this engine


def _missing_envoy(path: str) -> Any:
    raise PayloadError(f"the trace uses module {path!r}, which the server's model does not have")


class CompiledBlock:
    """One distinct block (its client file, function and source), compiled under a filename of its own."""

    def __init__(self, number: int, client_filename: str, co_name: str, source: str) -> None:
        self.filename = f"{client_filename} [serve block {number}]"
        self.client_filename = client_filename
        linecache.cache[self.filename] = (len(source), None, source.splitlines(keepends=True), self.filename)
        self.code = compile(source, self.filename, "exec").replace(co_name=co_name)
        self.node = ast.parse(source)  # what `_asks_for_grad` walks (once: it keeps its answer on the node)
        self.users = 0  # requests running it now

    def forget(self) -> None:
        """Drop its source and nnsight's parsed blocks for its filename."""
        linecache.cache.pop(self.filename, None)
        SOURCES.pop(self.filename, None)
        for key in [key for key in list(BLOCKS) if key[0] == self.filename]:
            BLOCKS.pop(key, None)


class _BlockCache:
    """The compiled blocks, least recently used dropped first, never while a request runs one.

    One lock around everything, parsing included: CPython 3.11's AST-to-Python converter keeps
    its recursion-depth check in per-interpreter state, so two threads in `ast.parse` at once can
    fail with "SystemError: AST constructor recursion depth mismatch" (seen under a 20-trace burst).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._blocks: OrderedDict[tuple[str, str, str], CompiledBlock] = OrderedDict()
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    def acquire(self, client_filename: str, co_name: str, source: str) -> CompiledBlock:
        key = (client_filename, co_name, source)
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                block = CompiledBlock(next(self._numbers), client_filename, co_name, source)
                self._blocks[key] = block
            self._blocks.move_to_end(key)
            block.users += 1
            self._evict()
            return block

    def release(self, block: CompiledBlock) -> None:
        with self._lock:
            block.users -= 1
            self._evict()

    def _evict(self) -> None:
        if len(self._blocks) <= self.size:
            return  # the common case: no walk over every cached block per request
        idle = [key for key, block in self._blocks.items() if block.users == 0]
        for key in idle[: max(0, len(self._blocks) - self.size)]:
            self._blocks.pop(key).forget()

    def __len__(self) -> int:
        return len(self._blocks)


BLOCKS_COMPILED = _BlockCache(BLOCK_CACHE_SIZE)


class ServerTrace:
    """One request's trace, bound to the server's model and ready to `execute` on a worker thread.

    `prompt_ids`: the client's ids for its text prompts, when its tokenizer is the server's (`prompt_ids`).
    """

    def __init__(
        self, tracer: NNrunTracer, block: CompiledBlock, prompt_ids: dict[str, list[int]] | None = None
    ) -> None:
        self.tracer = tracer
        self.block = block
        self.prompt_ids = prompt_ids
        self.filename = block.filename
        self.client_filename = block.client_filename

    @property
    def frame(self) -> SerializedFrame:
        return self.tracer.info.frame

    def release(self) -> None:
        """This request is done with its block (kept compiled for the next trace of it)."""
        if self.block is not None:
            BLOCKS_COMPILED.release(self.block)
            self.block = None


def load_trace(blob: bytes, model: Any) -> ServerTrace:
    """Unpickle a trace payload and bind it to `model` (the server's `ServedLanguageModel`)."""
    try:
        client_tracer, (source, glbls, variables) = ServerObjects(io.BytesIO(blob), model).load()
    except PayloadError:
        raise
    except Exception as error:
        raise PayloadError(
            f"the request body is not a serialized nnsight trace ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(client_tracer, Tracer) or not isinstance(source, str):
        raise PayloadError("the request body is not a serialized nnsight trace")
    kind = trace_kind(getattr(client_tracer, "fn", None))
    args = tuple(getattr(client_tracer, "args", ()))
    kwargs = dict(getattr(client_tracer, "kwargs", {}))
    tracer = NNrunTracer(model, kind, *args, **model.checked_kwargs(kind, kwargs))

    client_code = client_tracer.info.frame.f_code
    block = BLOCKS_COMPILED.acquire(client_code.co_filename, client_code.co_name, source)
    shipped_ids = client_tracer.__dict__.get(PROMPT_IDS_ATTRIBUTE)
    # The fingerprint's state check only for a payload that carries ids (not nnsight's client's, say).
    prompt_ids = accepted_prompt_ids(shipped_ids, model.tokenizer_fingerprint) if shipped_ids is not None else None
    trace = ServerTrace(tracer, block, prompt_ids)
    try:
        rebind = _Rebinder(model, {id(client_tracer): tracer})
        frame = SerializedFrame(block.filename, client_code.co_firstlineno, client_code.co_name)
        frame.f_globals = {name: rebind(value) for name, value in glbls.items()}
        frame.f_globals.setdefault("__builtins__", __builtins__)
        frame.f_locals = {name: rebind(value) for name, value in variables.items()}
    except BaseException:
        trace.release()
        raise
    tracer.info = Tracer.Info(frame, block.code)
    tracer.node = block.node  # read, never changed: `_asks_for_grad` and a mediator's serialization
    return trace


def load_block(scope: dict, model: Any, tracer: Any) -> dict:
    """A registered block's scope with the client's envoys and tracer swapped for the server's."""
    rebind = _Rebinder(model, {})
    rebound = {}
    for name, value in scope.items():
        if isinstance(value, Tracer):
            rebound[name] = tracer
        else:
            rebound[name] = rebind(value)
    return rebound


def trace_kind(fn: Any) -> str:
    """ "trace" or "generate", from the `fn` a client's tracer carries."""
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", None)
    if name in _TRACE_FNS:
        return "trace"
    if name in _GENERATE_FNS:
        return "generate"
    raise PayloadError(f"this server runs model.trace(...) and model.generate(...); the trace calls {name!r}")


class _Rebinder:
    """Swap client envoys (by path) and the client's tracer for the server's, inside containers too."""

    def __init__(self, model: Any, replace: dict[int, Any]) -> None:
        self.model = model
        self.replace = replace  # id of a client object -> its server counterpart
        self.memo: dict[int, Any] = {}

    def __call__(self, value: Any) -> Any:
        key = id(value)
        if key in self.replace:
            return self.replace[key]
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = value  # a container holding itself
        result = self._rebind(value)
        self.memo[key] = result
        return result

    def _rebind(self, value: Any) -> Any:
        if isinstance(value, Envoy):
            server_envoy = self.model.envoy_at(value.path)
            return server_envoy if server_envoy is not None else value
        if isinstance(value, list):
            value[:] = [self(item) for item in value]
            return value
        if isinstance(value, dict):
            for name in list(value):
                value[name] = self(value[name])
            return value
        if isinstance(value, tuple) and type(value) is tuple:
            return tuple(self(item) for item in value)
        return value
