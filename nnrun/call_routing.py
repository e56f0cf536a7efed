"""A module's calls routed through nnrun without hooks: its class swapped for a same-named subclass.

Decode graph pieces (`nnrun/graph_pieces.py`) route decoder layers this way, and a trace's LM head
(`interleaver/head_rows.py`) its own: the subclass's `__call__` decides per call, and the module's
`forward`, its hooks and anything installed on it (nnsight's controller) stay as they are.
"""

from __future__ import annotations

from typing import Any, Callable


def routed_class(cls: type, call: Callable[..., Any]) -> type:
    """A subclass of `cls` with the same name, module and qualified name, whose `__call__` is `call`."""
    return type(
        cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )
