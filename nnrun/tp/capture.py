"""Activation extraction on tensor-parallel ranks: which module values are whole there, and the exchange.

Extraction hooks modules of the model; on ranks the hooks run on rank 0's shard, and rank 0 sends
each module's flat `[N, ...]` value back. A hook sees a module's value after transformers' own
transforms: whole for the residual stream, an attention or MLP module's output, a row-parallel
projection's output (all-reduced) or a gathered head; one rank's piece for a column-parallel
projection's output, a row-parallel one's input, and every module between them (an MLP's
`act_fn`). Those are refused by name before anything runs: a piece is never written as the value.
"""

from __future__ import annotations

from typing import Any

from transformers.distributed.parallel_utils import _get_parameter_plan

from nnrun.extract.hooks import ModuleSpec
from nnrun.tp.plan import tensor_parallel_plan

# Styles whose output, after transformers' post-forward transform (what a forward hook sees), is whole.
_WHOLE_OUTPUT_STYLES = (
    "rowwise",
    "rowwise_rep",
    "rowwise_split_input",
    "packed_rowwise",
    "colwise_gather_output",
    "colwise_rep",
    "embedding_rowwise",
    "embedding_colwise",
    "all_reduce",
    "moe_tp_experts",
    "replicated_with_grad_allreduce",
)


def refuse_split_values(model: Any, specs: list[ModuleSpec], tp_size: int) -> None:
    """Raise if a spec names a value each rank holds only a piece of (see the module docstring)."""
    plan = tensor_parallel_plan(model)
    modules = dict(model.named_modules())

    def style(path: str) -> str | None:
        return _get_parameter_plan(path, plan, is_weight=False)

    def splits_its_output(path: str) -> bool:
        return style(path) not in (None, *_WHOLE_OUTPUT_STYLES)

    for spec in specs:
        own = style(spec.path)
        parent = spec.path.rpartition(".")[0]
        # A module beside one whose output is split runs inside a forward that passes pieces around.
        beside_split = any(
            splits_its_output(f"{parent}.{name}" if parent else name) for name in modules[parent]._modules
        )
        whole = own in _WHOLE_OUTPUT_STYLES and spec.io == "output" if own else not beside_split
        if not whole:
            raise ValueError(
                f"module {spec.name!r}: with tensor_parallel_size={tp_size} each rank holds only a piece of this "
                "value (it lies between sharded projections, or is one); extract a whole value instead (a layer's "
                "output, an attention or MLP module's output, a row-parallel projection's output), or run with "
                "tensor_parallel_size=1"
            )
