"""Per-request positions for modules that number positions themselves, applied as a pass over the built model.

The packed path gives the model each request's own positions as `position_ids` (0-based). Most
families use them; some compute positions of their own, which in a packed `[1, N]` batch run over
every request's tokens, or start where HF starts them:

- the decoders of encoder-decoder families (`*ForCausalLM` of bart, mbart, marian, pegasus, plbart,
  blenderbot, blenderbot-small, bigbird_pegasus) number positions `arange(N) + cache length` and
  hand them to their `embed_positions` module (the same kind of module in OPT and BioGPT is adapted
  too, and gets the ids it was given anyway);
- XGLM's sinusoidal table takes the model's `[1, N]` `position_ids` as they are (the step's already);
- roberta-style embeddings (roberta, xlm-roberta, xlm-roberta-xl, roberta-prelayernorm, camembert,
  data2vec-text, xmod) number positions from `padding_idx + 1`, as HF does when given no
  `position_ids`;
- Llama 4's NoPE attention layers scale their queries by a temperature of the position
  (`attn_temperature_tuning`), numbering positions `arange(N)` themselves: the attention glue
  rescales each packed query to its own position's temperature (`query_rescale`).

Inside an engine step the adapted module's `position_ids` argument becomes the step's per-request
positions (plus the family's offset); outside a step (a plain call, the load-time probe) it runs
exactly as HF's. Only the module's instance `forward` is replaced: no hooks (which would keep
decode steps off CUDA graphs), and module paths stay HF's.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Callable

import torch

from nnrun.attention.context import current_position_ids
from nnrun.attention.hf_glue import QUERY_RESCALE

_ADAPTED = "_nnrun_position_adapter"  # set on an adapted module: the pass runs once per model object
_SIGNATURE = "_nnrun_forward_signature"  # the module's HF forward signature, read once at install


@dataclass(frozen=True)
class PositionAdapter:
    """How one module takes the step's positions: `[1, N]` 0-based ids to its `position_ids` argument."""

    name: str
    to_module_positions: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    num_positions: Callable[[torch.nn.Module], int | None]  # how many positions it embeds; None: no fixed table


def _decoder_positions(module: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    return position_ids[0]  # [N]: these modules add their own offset and a batch dim to given ids


def _decoder_num_positions(module: torch.nn.Module) -> int | None:
    if not isinstance(module, torch.nn.Embedding):  # a table computed on demand
        return None
    return module.num_embeddings - getattr(module, "offset", 0)  # bart-style tables hold 2 extra rows


def _given_positions(module: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    return position_ids  # [1, N]: the module adds its own offset


def _padding_offset_positions(module: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    return position_ids + (module.padding_idx + 1)  # [1, N], numbered from padding_idx + 1 as HF does


def _padding_offset_num_positions(module: torch.nn.Module) -> int:
    return module.position_embeddings.num_embeddings - (module.padding_idx + 1)


DECODER_POSITIONS = PositionAdapter("decoder positions", _decoder_positions, _decoder_num_positions)
# No limit of its own: the table is built for the config's `max_position_embeddings`, which bounds the context
# already (a packed step grows it only to the step's token count, never past the largest position it is given).
SINUSOIDAL_POSITIONS = PositionAdapter("sinusoidal positions", _given_positions, lambda module: None)
PADDING_OFFSET_POSITIONS = PositionAdapter(
    "positions from padding_idx + 1", _padding_offset_positions, _padding_offset_num_positions
)


def adapter_for(module: torch.nn.Module) -> PositionAdapter | None:
    """The adapter a module needs, by what it is in HF, or None."""
    parameters = _forward_parameters(module)
    if "position_ids" not in parameters:
        return None
    if hasattr(module, "create_position_ids_from_input_ids") and hasattr(module, "padding_idx"):
        return PADDING_OFFSET_POSITIONS
    if type(module).__name__.endswith("PositionalEmbedding") and "past_key_values_length" in parameters:
        takes_position_ids_first = parameters[1] == "position_ids"  # XGLM's; bart's and OPT's take other ids first
        return SINUSOIDAL_POSITIONS if takes_position_ids_first else DECODER_POSITIONS
    return None


def adapt_positions(model: torch.nn.Module) -> list[str]:
    """Adapt every module of `model` that numbers positions itself; returns their paths (idempotent)."""
    adapted = []
    for path, module in model.named_modules():
        if _has_position_temperature(module):
            module.__dict__[QUERY_RESCALE] = llama4_query_rescale
            adapted.append(path)
            continue
        adapter = getattr(module, _ADAPTED, None) or adapter_for(module)
        if adapter is None:
            continue
        if getattr(module, _ADAPTED, None) is None:
            _install(module, adapter)
        adapted.append(path)
    return adapted


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence the adapted modules can number (a roberta table of 514 rows holds 512), or None."""
    limits = [
        adapter.num_positions(module)
        for module in model.modules()
        if (adapter := getattr(module, _ADAPTED, None)) is not None
    ]
    return min((limit for limit in limits if limit is not None), default=None)


def _install(module: torch.nn.Module, adapter: PositionAdapter) -> None:
    # A method bound to the module (not a closure over it): a deep copy of the model rebinds it to the copy.
    module.forward = types.MethodType(_adapted_forward, module)
    module.__dict__[_SIGNATURE] = inspect.signature(type(module).forward)
    setattr(module, _ADAPTED, adapter)


def _adapted_forward(self: torch.nn.Module, *args, **kwargs):
    """HF's own forward; inside a step, with the step's per-request positions as its `position_ids`."""
    hf_forward = type(self).forward
    step_positions = current_position_ids()
    if step_positions is None:
        return hf_forward(self, *args, **kwargs)
    bound = self.__dict__[_SIGNATURE].bind(self, *args, **kwargs)
    bound.arguments["position_ids"] = getattr(self, _ADAPTED).to_module_positions(self, step_positions)
    return hf_forward(*bound.args, **bound.kwargs)


def _has_position_temperature(module: torch.nn.Module) -> bool:
    """A Llama 4 attention layer without RoPE that scales its queries by position (HF's temperature tuning)."""
    return (
        hasattr(module, "floor_scale")
        and hasattr(module, "attn_scale")
        and hasattr(module, "use_rope")
        and bool(getattr(module, "attn_temperature_tuning", False))
        and not module.use_rope
    )


def _temperature(module: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """HF Llama 4's query temperature at `positions` (`[N]`), float32."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def llama4_query_rescale(module: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """`[N]` factors taking each query from the temperature HF gave it to its own position's.

    In a packed step HF numbers the `[1, N]` batch `0..N-1` (no cache), not each request's positions;
    both temperatures are 1 below `floor_scale - 1`, where the factor is exactly 1.
    """
    positions = position_ids[0]  # [N]
    packed = torch.arange(positions.shape[0], device=positions.device)  # [N] what HF numbered them
    return _temperature(module, positions) / _temperature(module, packed)


def _forward_parameters(module: torch.nn.Module) -> list[str]:
    """The names of the module's HF forward parameters, `self` first, in order."""
    try:
        return list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return []
