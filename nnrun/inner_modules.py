"""Modules that run inside a packed step once per request (or group), where nobody may watch them.

A state-space mixer or a sparse-attention indexer runs its own modules (projections, conv, norm)
once per request or group of requests, on `[1, T_i, ...]`, `[G, n, ...]` or `[B, 1, ...]` values,
not once on the step's `[1, N, ...]`: an intervention or hook there would be handed another
request's values, or its own at a later step. So while such a module runs, the per-instance
`forward` wrappers an interpreter such as nnsight installs on its inner modules are set aside (a
read there is never served, and the trace says so), and a torch hook on them is refused with the
reason. The outer module's own input and output stay each request's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def inner_modules_unseen(outer: torch.nn.Module, kind: str, layer_idx: int | None, runs_per: str) -> Iterator[None]:
    """Run `outer` with its inner modules' interpreter wrappers set aside; refuse torch hooks on them.

    `kind` names the outer module in the refusal ("mixer", "indexer"), `runs_per` says how its
    inner modules run ("once per request").
    """
    inner = [module for module in outer.modules() if module is not outer]
    hooked = [type(m).__name__ for m in inner if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        raise RuntimeError(
            f"hooks on {hooked} inside {type(outer).__name__} (layer {layer_idx}): on nnrun's packed path a "
            f"{kind} runs its modules {runs_per}, so they never see the step's [1, N, ...] values; hook the "
            f"{kind} itself, or load the model with forward_path='exact'"
        )
    # accelerate's own wrapper (`_hf_hook`: device placement of offloaded weights) must keep running
    set_aside = [
        (module, module.__dict__.pop("forward"))
        for module in inner
        if "forward" in module.__dict__ and not hasattr(module, "_hf_hook")
    ]
    try:
        yield
    finally:
        for module, forward in set_aside:
            module.__dict__["forward"] = forward
