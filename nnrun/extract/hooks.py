"""Module hooks that keep each named module's flat `[1, N, ...]` value from one packed forward.

The fast path of extraction: plain forward (pre-)hooks on the HF modules, no nnsight mediators.
A hook only copies the flat value; cutting it into prompts happens after the forward, by the
token ranges the runner reports for the batch (never inferred from shapes).
"""

from __future__ import annotations

import difflib
import threading
from dataclasses import dataclass
from typing import Any

import torch

_IO = ("input", "output")


@dataclass(frozen=True)
class ModuleSpec:
    """A module value to extract: `name` as the user wrote it, the HF module path, and input or output."""

    name: str
    path: str
    io: str = "output"

    def __post_init__(self) -> None:
        if self.io not in _IO:
            raise ValueError(f"ModuleSpec.io must be 'input' or 'output', got {self.io!r}")
        if not self.path:
            raise ValueError("ModuleSpec.path must name a submodule, got ''")


def resolve_modules(model: torch.nn.Module, names: list[str] | str) -> list[ModuleSpec]:
    """Parse "model.layers.6", "model.layers.6.mlp.output", "model.layers.6.self_attn.input" against the model."""
    if isinstance(names, str):
        names = [names]
    if not names:
        raise ValueError("modules must name at least one module")
    known = {path for path, _ in model.named_modules() if path}
    specs: list[ModuleSpec] = []
    for name in names:
        path, _, last = name.rpartition(".")
        if name in known:
            spec = ModuleSpec(name, name, "output")
        elif last in _IO and path in known:
            spec = ModuleSpec(name, path, last)
        else:
            close = difflib.get_close_matches(name.removesuffix(".output").removesuffix(".input"), known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"module {name!r} is not in {type(model).__name__}'s module tree{hint}")
        if any((s.path, s.io) == (spec.path, spec.io) for s in specs):
            raise ValueError(f"module {name!r} is listed twice")
        specs.append(spec)
    return specs


def _first_tensor(value: Any, what: str) -> torch.Tensor:
    """The module's main tensor: itself, or the first element of a tuple / ModelOutput."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    if hasattr(value, "to_tuple") and value.to_tuple() and isinstance(value.to_tuple()[0], torch.Tensor):
        return value.to_tuple()[0]
    raise TypeError(f"{what} is a {type(value).__name__}, not a tensor or a tuple starting with one")


class StopForward(Exception):
    """Raised by the hook that captures the last wanted value: the rest of the model is not needed."""


class ActivationCapture:
    """Hooks on the named modules for the duration of a `with` block; `take()` hands over the values.

    Each hook keeps a copy of its module's flat value `[N, ...]` in the store dtype (a copy,
    because later modules may update tensors in place). The block must cover exactly one
    packed forward per `take()`. With `stop_early`, the hook that completes the set raises
    StopForward, so layers after the deepest wanted module never run (the values captured
    are the same: nothing before a module depends on what comes after it).

    `run_prefill_only` runs the forward on the calling thread, so hooks ignore calls from other
    threads: an engine step serving other requests meanwhile is not ours.
    """

    def __init__(
        self, model: torch.nn.Module, specs: list[ModuleSpec], dtype: torch.dtype, stop_early: bool = False
    ) -> None:
        self.model = model
        self.specs = specs
        self.dtype = dtype
        self.stop_early = stop_early
        self._values: dict[str, list[torch.Tensor]] = {s.name: [] for s in specs}
        self._handles: list[Any] = []
        self._thread_id: int | None = None

    def __enter__(self) -> "ActivationCapture":
        self._thread_id = threading.get_ident()
        for spec in self.specs:
            module = self.model.get_submodule(spec.path)
            if spec.io == "output":
                hook = self._output_hook(spec)
                self._handles.append(module.register_forward_hook(hook))
            else:
                hook = self._input_hook(spec)
                self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keep(self, spec: ModuleSpec, value: Any) -> None:
        if threading.get_ident() != self._thread_id:
            return
        tensor = _first_tensor(value, f"{spec.name} ({spec.io} of {spec.path})")
        if tensor.dim() < 2 or tensor.shape[0] != 1:
            raise ValueError(f"{spec.name}: expected a packed [1, N, ...] value, got shape {tuple(tensor.shape)}")
        self._values[spec.name].append(tensor[0].detach().to(self.dtype, copy=True))  # [N, ...]
        if self.stop_early and all(self._values.values()):
            raise StopForward()

    def _output_hook(self, spec: ModuleSpec):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            self._keep(spec, output)

        return hook

    def _input_hook(self, spec: ModuleSpec):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            # nnsight's `.input`: the first positional argument, else the first keyword argument.
            value = args[0] if args else next(iter(kwargs.values()), None)
            self._keep(spec, value)

        return hook

    def take(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """Each module's flat value `[N, ...]` from the forward that just ran, and forget them."""
        values = {}
        for spec in self.specs:
            kept = self._values[spec.name]
            if len(kept) != 1 or kept[0].shape[0] != num_tokens:
                shapes = [tuple(t.shape) for t in kept]
                raise RuntimeError(
                    f"{spec.name}: expected one value of {num_tokens} tokens from the forward, "
                    f"got {shapes} (is the module called more than once per forward?)"
                )
            values[spec.name] = kept[0]
            kept.clear()
        return values


def gather_rows(flat: torch.Tensor, starts: list[int], lengths: list[int], positions: str) -> torch.Tensor:
    """Prompts' rows from a flat `[N, ...]` value, back to back in batch order.

    positions="all": every token of every prompt (`[sum(lengths), ...]`); "last": each prompt's
    last token (`[num_prompts, ...]`).
    """
    if positions == "last":
        last = torch.tensor([s + n - 1 for s, n in zip(starts, lengths)], device=flat.device)  # [num_prompts]
        return flat.index_select(0, last)
    if starts == packed_starts(lengths) and sum(lengths) == flat.shape[0]:
        return flat  # the usual packing: prompts already back to back, in order
    return torch.cat([flat[s : s + n] for s, n in zip(starts, lengths)])


def packed_starts(lengths: list[int]) -> list[int]:
    """Start of each prompt when prompts are packed back to back in order."""
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts
