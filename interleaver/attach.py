"""Modules attached to the client tree (`model.model.layers[0].adapter = Adapter()`) reach the engine.

The client tree and the runner's tree wrap the same HF modules, each registering its own
interleaver on every module's controller. A module attached after both were built is added to
the shared HF module by the client tree, but only the client's interleaver is registered on it,
and that one never runs a forward: called inside a block with `hook=True` (nnsight's adapter or
SAE pattern), the module would serve nothing and a trace reading `.adapter.inner.output` would
wait for a visit that never comes. So each module the client tree wraps is mirrored on the
runner's tree, at the same path, which registers the engine's interleaver on it.
"""

from __future__ import annotations

from typing import Any

import torch


def mirror_on_engine(client_parent: Any, name: str, module: torch.nn.Module) -> None:
    """Give `module` (now `client_parent.<name>`) an envoy in the runner's tree too."""
    engine = client_parent.interleaver.engine_interleaver
    if engine is None:  # no engine yet (a meta tree): it is attached to the engine's model when that is built
        return
    if engine.envoys.get(id(module)) is not None:  # built with the model: the runner tree has it
        return
    runner_parent = engine.envoys.get(id(client_parent._module))
    if runner_parent is None:
        # The parent is itself being attached (its client envoy wraps its children first): mirroring
        # the parent next builds this whole subtree in the runner's tree.
        return
    runner_parent._wrap_envoy(name, module)
