"""`.source` on the client tree, recursion into called functions included.

A module's `.source` needs nothing special: the instrumented forward lives on the HF module, and
its operations find the engine's interleaver through the module's controller routes. Recursing
(`...source.apply_rotary_pos_emb_0.source.rotate_half_0`) is different: nnsight asks the
operation's envoy for its interleaver, parks on `{op}.fn` to be handed the live callable, and
caches the instrumented copy in `interleaver.sourced`; the client envoy's interleaver never runs
a forward. So a client `Source` hands its operations an `EngineRoute` whose interleaver is the
engine's, and nnsight's own drilling then runs on the engine thread.

One callable is refused: nnrun's attention implementation (`paged_attention_forward`, what
`attention_interface(...)` calls on nnrun). Its operations are the engine's paged kernels over
the whole packed step, not transformers' attention function that nnsight drills into on HF, so
their names and values would not be HF's. The call itself (`attention_interface_1.inputs` /
`.output`) is served as on HF.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from greenlet import getcurrent

from nnsight.intervention.source import Source, SourceEnvoy, SourceNotAvailable, install_source


class EngineAttentionSourceError(SourceNotAvailable):
    """`.source` of the attention call: nnrun's attention runs the engine's kernels, not HF's function."""


class EngineRoute:
    """Stands in for a client envoy under its `Source`: the same envoy, with the engine's interleaver."""

    def __init__(self, envoy: Any) -> None:
        self.envoy = envoy
        self.interleaver = envoy.interleaver.engine_interleaver

    def __getattr__(self, name: str) -> Any:
        return getattr(self.envoy, name)


class EngineSourceEnvoy(SourceEnvoy):
    """One operation of a client `Source`; its `.source` drills in on the engine's interleaver."""

    @property
    def source(self) -> Source:
        if getattr(getcurrent(), "mediator", None) is None:  # only a block's worker can be handed the callable
            raise SourceNotAvailable("recursive `.source` is only available inside a trace")
        drilled = SourceEnvoy.source.fget(self)  # parks on `{path}.fn`, instruments what it is handed
        sourced = self.envoy.interleaver.sourced
        entry = sourced.get(self.path)
        if entry is not None and callable_identity(entry[0]) == callable_identity(engine_attention()):
            del sourced[self.path]  # the call runs the attention as is
            raise EngineAttentionSourceError(
                f"{self.path}: this call is nnrun's attention ({engine_attention().__qualname__}), which runs the "
                "engine's paged kernels over the whole packed step instead of transformers' attention function, so "
                "its operations are not HF's and nnrun does not drill into it. Read or edit the call itself: "
                f"`{self.name}.inputs` (query, key, value, ...) and `{self.name}.output` are served as on HF."
            )
        return EngineSource(self.envoy, self.path, drilled.compiled)


class EngineSource(Source):
    """A client module's (or drilled callable's) operations, whose recursion reaches the engine."""

    def node(self, name: str) -> SourceEnvoy:
        plain = super().node(name)
        return EngineSourceEnvoy(plain.envoy, plain.name, plain.path, plain.text, plain.line)


def client_source(envoy: Any) -> Source:
    """`envoy.source` for a client envoy (instruments the module's forward once, inert outside traces)."""
    return EngineSource(EngineRoute(envoy), envoy.path, install_source(envoy))


CALLABLE_SUFFIX = ".fn"  # `{op}.fn`: where an operation hands its live callable to a block drilling into it


def forget_if_other_callable(sourced: dict, op_path: str, fn: Any) -> None:
    """Drop a drilled copy kept across steps if the operation now calls something else.

    nnsight's `run_op` runs the cached copy in place of whatever the operation calls; kept over
    several steps (and traces), the callable behind one operation may change (another attention
    implementation, say), and the copy must then not stand in for it.
    """
    entry = sourced.get(op_path)
    if entry is not None and callable_identity(entry[0]) != callable_identity(fn):
        sourced[op_path] = None


def engine_attention() -> Callable:
    """The function transformers calls as attention on nnrun."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from nnrun.attention.hf_glue import ATTN_IMPLEMENTATION

    return ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]


def callable_identity(fn: Any) -> tuple[str | None, str | None]:
    """What a drilled callable is, comparable between the live one and its instrumented copy.

    The copy is a new function with the original's module and qualified name; a callable instance
    is instrumented through its `__call__`.
    """
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        fn = type(fn).__call__ if callable(fn) else fn  # a callable instance: its class's __call__
    return getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
