"""RankFragments: nnsight's `TPFragments`, plus the split values transformers' plan does not name.

nnsight gathers a value only at the two sides of a module the plan shards (a `q_proj`'s output).
Between a column-parallel and a row-parallel layer other modules see split values too (an MLP's
`act_fn`, Qwen3's per-head `q_norm`), and nnsight hands those over as one rank's piece, which a
block would read as HF's value with the wrong shape. A rank finds them at load: one forward of
the sharded model and one of the whole model on the meta device, module by module; where a
tensor's size on one dim is the whole size over the ranks, that location is gathered on that dim
before a block sees it and split back after. Inside the forward of a module whose own children
are sharded (an attention's `.source`), values are split on axes no module boundary describes:
a block reading one is refused by name instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from nnsight.modeling.tp import TPFragments

from nnrun.attention import AttentionBackend, forward_context, hf_masks_skipped


class SplitValueError(ValueError):
    """A value inside a sharded module's forward: each rank holds a piece, on an axis nnrun cannot name."""


class RankFragments(TPFragments):
    def __init__(self) -> None:
        super().__init__()
        self.split_dims: dict[str, list[int | None]] = {}  # location -> per tensor leaf, the dim split over ranks
        self.split_bodies: set[str] = set()  # module paths whose forward works on split values
        self.refused: set[str] = set()  # locations split in a way nnrun cannot undo: a read is refused
        self.interleaver: Any = None  # set by the runner: a refused read is thrown into the blocks parked on it

    def learn_split_values(self, model: torch.nn.Module, skeleton: torch.nn.Module, root: str = "model") -> None:
        """Compare the sharded model's module values with the whole model's, on the meta device."""
        world = dist.get_world_size()
        for name, module in model.named_modules():
            path = f"{root}.{name}" if name else root
            if any(self._splits_values(f"{path}.{child}") for child, _ in module.named_children()):
                self.split_bodies.add(path)
        ours = _module_shapes(model, torch.device(_device_of(model)))
        try:
            theirs = _module_shapes(skeleton, "meta")
        except Exception:  # the family's forward does not run on meta tensors: refuse what may be split
            theirs = None
        for key, shapes in ours.items():
            whole_shapes = None if theirs is None else theirs.get(key)
            location = f"{root}.{key}"
            if shapes == whole_shapes or self._plainly_whole(location, theirs is None):
                continue
            dims = [_split_dim(a, b, world) for a, b in zip(shapes, whole_shapes or [])]
            if (
                whole_shapes is None
                or len(whole_shapes) != len(shapes)
                or any(a != b and dim is None for a, b, dim in zip(shapes, whole_shapes, dims))
            ):
                self.refused.add(location)
            else:
                self.split_dims[location] = dims

    def _plainly_whole(self, location: str, unknown: bool) -> bool:
        """A value nnsight already makes whole, or (shapes unknown) one outside every split body."""
        if super().fragmented(location):
            return True
        module = location.rsplit(".", 1)[0]
        parent = module.rsplit(".", 1)[0]
        return unknown and parent not in self.split_bodies

    def _splits_values(self, path: str) -> bool:
        """A module the plan shards so that its values are pieces on one side (a column- or row-parallel one)."""
        return super().fragmented(f"{path}.output") or super().fragmented(f"{path}.input")

    # ---- nnsight's Fragments protocol --------------------------------------------------------
    def fragmented(self, location: str) -> bool:
        return (
            super().fragmented(location)
            or location in self.split_dims
            or location in self.refused
            or self._in_split_body(location)
        )

    def whole(self, location: str, value: Any) -> tuple[Any, Any]:
        if super().fragmented(location):
            return super().whole(location, value)
        if location in self.split_dims:
            return self._gathered(location, value)
        self._refuse(location)
        return value, None

    def split(self, location: str, whole: Any) -> Any:
        if location in self.split_dims and not super().fragmented(location):
            return self._resplit(self.split_dims[location], whole)
        return super().split(location, whole)

    # ---- gathering what the plan leaves split ----------------------------------------------------
    def _gathered(self, location: str, value: Any) -> tuple[Any, Any]:
        dims = self.split_dims[location]
        leaves, spec = tree_flatten(value)
        if len(leaves) != len(dims):
            self._refuse(location)
            return value, None
        whole = [_all_gather(leaf, dim) if dim is not None else leaf for leaf, dim in zip(leaves, dims)]
        return tree_unflatten(whole, spec), lambda edited: self._resplit(dims, edited)

    @staticmethod
    def _resplit(dims: list[int | None], value: Any) -> Any:
        leaves, spec = tree_flatten(value)
        world, rank = dist.get_world_size(), dist.get_rank()
        pieces = [
            leaf.chunk(world, dim)[rank] if dim is not None and isinstance(leaf, torch.Tensor) else leaf
            for leaf, dim in zip(leaves, dims + [None] * (len(leaves) - len(dims)))
        ]
        return tree_unflatten(pieces, spec)

    # ---- refusing what cannot be made whole ------------------------------------------------------
    def _in_split_body(self, location: str) -> bool:
        head, found, _ = location.partition(".source.")
        return bool(found) and head in self.split_bodies

    def _refuse(self, location: str) -> None:
        """Raise in every block parked on `location`, at its line; the forward goes on unread."""
        world = dist.get_world_size()
        module, inside, _ = location.partition(".source.")
        where = f"values inside {module}'s forward are" if inside else "this value is"
        error = SplitValueError(
            f"{location}: on tensor-parallel ranks {where} split over the {world} ranks (between sharded "
            "projections) on axes nnrun cannot reassemble for you; read a module's .input/.output outside "
            "the split (the attention or MLP module's own, or its projections'), or run with tensor_parallel_size=1"
        )
        for mediator in self.interleaver._ready(location):
            try:
                mediator.pending = mediator.throw(error)
            except Exception as raised:  # the block did not catch it: its request ends with it
                mediator.exception = raised
                mediator.pending = None


def _module_shapes(model: torch.nn.Module, device: Any) -> dict[str, list[tuple[int, ...] | None]]:
    """`<module>.input` / `<module>.output` -> the shape of each tensor leaf, over one forward of 4 tokens."""
    shapes: dict[str, list[tuple[int, ...] | None]] = {}

    def leaf_shapes(value: Any) -> list[tuple[int, ...] | None]:
        leaves, _ = tree_flatten(value)
        return [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]

    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def record_input(module, args, kwargs, name=name):
            shapes.setdefault(f"{name}.input", leaf_shapes((args, kwargs)))

        def record_output(module, args, output, name=name):
            shapes.setdefault(f"{name}.output", leaf_shapes(output))

        handles.append(module.register_forward_pre_hook(record_input, with_kwargs=True))
        handles.append(module.register_forward_hook(record_output))
    try:
        input_ids = torch.ones((1, 4), dtype=torch.int64, device=device)
        positions = torch.arange(4, device=device)[None]
        # As in an engine step: no mask is built (HF's builder asks `.item()` questions meta tensors
        # cannot answer) and attention goes to a backend, here one that only gets the shapes right.
        with forward_context(_ShapeBackend()), hf_masks_skipped(), torch.no_grad():
            model(input_ids=input_ids, position_ids=positions, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return shapes


class _ShapeBackend(AttentionBackend):
    """Attention that returns zeros of the right shape: enough to learn every module's value shapes."""

    name = "shapes"

    def __init__(self) -> None:
        pass

    def init_forward_metadata(self, forward_batch: Any) -> None:
        pass

    def forward(self, layer_idx, q, k, v, terms):
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))  # [N, Hq, Dv]


def _split_dim(ours: tuple[int, ...] | None, whole: tuple[int, ...] | None, world: int) -> int | None:
    if ours is None or whole is None or ours == whole or len(ours) != len(whole):
        return None
    differing = [d for d, (a, b) in enumerate(zip(ours, whole)) if a != b]
    if len(differing) == 1 and ours[differing[0]] * world == whole[differing[0]]:
        return differing[0]
    return None


def _all_gather(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.contiguous())
    return torch.cat(pieces, dim=dim)


def _device_of(model: torch.nn.Module) -> str:
    for parameter in model.parameters():
        local = getattr(parameter, "_local_tensor", parameter)
        return str(local.device)
    return "cpu"
