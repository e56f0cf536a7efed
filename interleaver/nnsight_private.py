"""Every private part of nnsight that nnrun relies on, in one place: the upgrade path when nnsight moves.

nnrun runs nnsight's own tracers, mediators and envoys, so it reaches past nnsight's public API in
a few places. The private names are imported here, each with the reason nnrun needs it (`PRIVATE_NAMES`),
and the rest of nnrun imports them from here. The private attributes it reads and writes are listed in
`PRIVATE_ATTRIBUTES`. At import the installed nnsight is compared with the version all of this was
written for; another version warns once, and every name here is checked to exist, so an nnsight
that moved one fails at import naming it, not deep inside a user's trace.
"""

from __future__ import annotations

import warnings

import nnsight
from nnsight._c import mount as mount_save
from nnsight._c import unmount as unmount_save
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.serialization import _referenced_names as referenced_names
from nnsight.tracing.tracer import _local as tracing_thread_state
from nnsight.tracing.tracer import _saves as saved_value_ids

WRITTEN_FOR = "0.8.1"
__all__ = [
    "PRIVATE_ATTRIBUTES",
    "PRIVATE_NAMES",
    "WRITTEN_FOR",
    "mount_save",
    "referenced_names",
    "saved_value_ids",
    "tracing_thread_state",
    "unmount_save",
]

# What each private name imported above is, and why nnrun needs it:
PRIVATE_NAMES = {
    "nnsight.tracing.tracer._saves (saved_value_ids)": "the ids of the values `.save()` marked in this thread's trace: nnrun's tracer keeps a trace's saved "
    "values alive past the step (and unpins the engine's views) by checking membership here",
    "nnsight.tracing.tracer._local (tracing_thread_state)": "nnsight's per-thread tracing state: `depth` > 0 while a trace body runs on this thread; the engine "
    "thread opens one before its blocks run, so `.save()` inside them works",
    "nnsight.intervention.serialization._referenced_names (referenced_names)": "the names a block's source refers to: the server caches a block's source with them, so a trace "
    "sent again is not re-parsed",
    "nnsight._c.mount / unmount (mount_save, unmount_save)": "nnsight's C extension mounts `.save()` on every object; the server unmounts it for the moment it "
    "imports a module whose import would otherwise fail on an object that has `.save`",
}

# Attributes of nnsight objects nnrun reads or sets (no public accessor exists for these):
PRIVATE_ATTRIBUTES = {
    "Envoy._module": "the wrapped torch module (the HF module an envoy stands for)",
    "Envoy._wrap_envoy": "wraps a module attached after the tree was built, on the engine's tree too",
    "Envoy._envoys / _children": "the tree's envoy index and child list (the generator envoy is added there)",
    "Envoy._edits": "the mediators `model.edit()` stored, replayed first on every prompt of later traces",
    "Tensor._nnsight_batch": "marks a served view so that `.grad` redirects to the tensor in the graph",
    "BaseException.__intervention_tb__": "the traceback of the user's line, kept where nnsight keeps it",
    "State.body / State.routes (module.__dict__[STATE])": "a decoder layer watched only at its input or output "
    "runs its graph piece as the controller's body for one call, between its handoffs; `routes` names those "
    "handoffs' locations (interleaver/watched_layers.py)",
    "Controller.state.original": "a module's own forward under nnsight's controller: compiled decoder layers "
    "(nnrun/compiled_layers.py) compile it, with the controllers set aside, inside the captured graphs",
}


def _check_installed() -> None:
    if nnsight.__version__ != WRITTEN_FOR:
        warnings.warn(
            f"nnrun was written for nnsight {WRITTEN_FOR}, found {nnsight.__version__}; the private "
            "parts it relies on are listed in interleaver/nnsight_private.py",
            stacklevel=2,
        )
    if not callable(getattr(Envoy, "_wrap_envoy", None)):
        raise ImportError(
            f"nnsight {nnsight.__version__} has no Envoy._wrap_envoy, which nnrun relies on "
            "(see interleaver/nnsight_private.py)"
        )


_check_installed()
