"""What a client envoy says when it is used wrongly: a value read outside a trace, a misspelled name.

nnsight's own words are its internals' (`Cannot access ... outside of interleaving`); these say
what to write instead.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from greenlet import getcurrent

# What an envoy offers besides its module's submodules and attributes: the values a trace reads.
ENVOY_VALUES = ("output", "input", "inputs")


class InsideTrace:
    """An envoy value (`.output`, `.input`, `.inputs`) that exists only while a trace runs: outside one, say so."""

    def __init__(self, value_property: Any, name: str) -> None:
        self.value_property = value_property
        self.name = name
        self._get = value_property.__get__  # (bound once: every read of a value goes through here)

    def __get__(self, envoy: Any, owner: Any = None) -> Any:
        if envoy is None:
            return self.value_property
        try:
            return self._get(envoy, owner)
        except ValueError as error:
            raise _outside_trace(envoy, self.name, "read") or error from None

    def __set__(self, envoy: Any, value: Any) -> None:
        try:
            self.value_property.__set__(envoy, value)
        except ValueError as error:
            raise _outside_trace(envoy, self.name, "set") or error from None


def _outside_trace(envoy: Any, name: str, verb: str) -> ValueError | None:
    if getattr(getcurrent(), "mediator", None) is not None:  # inside a block: the error is the block's own
        return None
    where = user_path(f"{envoy.path}.{name}")
    return ValueError(
        f"`{where}` can only be {verb} inside `with model.trace(...)` (or `model.generate(...)`): it is a value "
        f"of a run of the model, which exists while the block runs. For example:\n"
        f"    with model.trace(prompt):\n"
        f"        value = {where}.save()\n"
        f"    print(value)"
    )


def user_path(path: str) -> str:
    """An envoy path as the user writes it: `model.model.layers.1.output` -> `model.model.layers[1].output`."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", path)


def missing_attribute(envoy: Any, module: Any, name: str) -> AttributeError:
    """No submodule or attribute `name`: the close names once each, an envoy value (`.output`) among them."""
    children = list(module._modules)
    attributes = [n for n in dir(module) if not n.startswith("_")]  # dir() lists the submodules again
    candidates = list(dict.fromkeys([*children, *ENVOY_VALUES, *attributes]))
    close = difflib.get_close_matches(name, candidates, n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return AttributeError(
        f"{envoy.path}.{name}: {type(module).__name__} at {envoy.path!r} has no submodule or attribute "
        f"{name!r}{hint} (its submodules: {', '.join(children) or 'none'})"
    )
