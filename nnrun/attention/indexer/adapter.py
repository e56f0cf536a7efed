"""Sparse-attention indexers run per request inside a packed forward: a pass over the built model.

Like `nnrun/state/mixers.py`, every DSA indexer module (its HF forward keeps its keys in HF's cache
through `update_indexer`: DeepSeek-V3.2's, GLM-MoE-DSA's, HY-V4's, AXK2's) gets an instance
`forward` that, inside a packed step, runs HF's own forward per group of requests on their own keys
(`IndexerStep.run`). The attention module that owns one gets an instance `forward` that hands HF's
code an empty mask where a packed step has none (HF slices `attention_mask[:, 0]` for the indexer,
which ignores it there; the paged attention masks each request itself). Outside a step both are
HF's forwards unchanged. No hooks, and module paths stay HF's: nnsight sees the indexer's output as
`[1, N, K]` picks, each invoke's rows its own.
"""

from __future__ import annotations

import inspect
import types

import torch

from nnrun.attention.context import current_backend, current_indexer_step
from nnrun.attention.indexer.keys import IndexerInfo
from nnrun.attention.masks import allowed_keys
from nnrun.inner_modules import inner_modules_unseen

_ADAPTED = "_nnrun_indexer"  # IndexerInfo on an adapted indexer: the pass runs once per model object
_MASK_ADAPTED = "_nnrun_indexed_attention"  # on an adapted attention module
_SIGNATURE = "_nnrun_forward_signature"
# What HF's DSA indexer forward takes, in order (its attention module passes the first five positionally).
INDEXER_PARAMETERS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids")
PROBE_BACKEND = "probe"  # the load-time probe's backend (nnrun/model_probe.py): it records shapes, not values


def indexer_info(module: torch.nn.Module) -> IndexerInfo | None:
    """The module's IndexerInfo if it is a DSA indexer whose keys HF keeps through `update_indexer`, else None."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    layer_idx, head_dim = getattr(module, "layer_idx", None), getattr(module, "head_dim", None)
    if code is None or "update_indexer" not in code.co_names or not isinstance(layer_idx, int):
        return None
    parameters = tuple(inspect.signature(forward).parameters)
    if parameters[1 : len(INDEXER_PARAMETERS) + 1] != INDEXER_PARAMETERS or "past_key_values" not in parameters:
        return None
    return IndexerInfo(layer_idx, head_dim) if isinstance(head_dim, int) else None


def adapt_indexers(model: torch.nn.Module) -> list[IndexerInfo]:
    """Adapt every DSA indexer of `model` and the attention modules owning them (idempotent); by `layer_idx`."""
    indexers = []
    for module in model.modules():
        info = getattr(module, _ADAPTED, None) or indexer_info(module)
        if info is None:
            continue
        if getattr(module, _ADAPTED, None) is None:
            # A method bound to the module (not a closure over it): a deep copy of the model rebinds it to the copy.
            module.forward = types.MethodType(_indexer_forward, module)
            setattr(module, _ADAPTED, info)
        indexers.append(info)
    for module in model.modules():
        if getattr(getattr(module, "indexer", None), _ADAPTED, None) is not None and not hasattr(module, _MASK_ADAPTED):
            module.forward = types.MethodType(_indexed_attention_forward, module)
            module.__dict__[_SIGNATURE] = inspect.signature(type(module).forward)
            setattr(module, _MASK_ADAPTED, True)
    return sorted(indexers, key=lambda info: info.layer_idx)


def unserved_indexers(model: torch.nn.Module) -> list[str]:
    """Class names of the model's indexers the packed path cannot run (not DSA-shaped: DeepSeek-V4's)."""
    names = {
        type(module).__name__
        for module in model.modules()
        if type(module).__name__.endswith("Indexer") and indexer_info(module) is None
    }
    return sorted(names)


def _indexed_attention_forward(self: torch.nn.Module, *args, **kwargs):
    """HF's own forward; inside a packed step, with an empty mask for HF's code to slice where it has none."""
    hf_forward = type(self).forward
    if current_backend() is None:
        return hf_forward(self, *args, **kwargs)
    bound = self.__dict__[_SIGNATURE].bind(self, *args, **kwargs)
    if bound.arguments.get("attention_mask") is None:
        hidden_states = bound.arguments["hidden_states"]
        # [1, 1, 0, 0]: no query sees any key through it; the backend masks each request by its own span
        bound.arguments["attention_mask"] = torch.ones((1, 1, 0, 0), dtype=torch.bool, device=hidden_states.device)
    return hf_forward(*bound.args, **bound.kwargs)


def _indexer_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    past_key_values=None,
) -> torch.Tensor:
    """HF's own forward; inside a packed step, once per group of requests on their own keys."""
    hf_forward = type(self).forward
    backend, step = current_backend(), current_indexer_step()
    if backend is None:  # a plain call: HF's, as given
        return hf_forward(
            self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, past_key_values
        )
    if step is None:
        if backend.name != PROBE_BACKEND:
            raise RuntimeError(
                f"{type(self).__name__} (layer {self.layer_idx}) ran in a packed forward without the step's "
                "indexer layout (serve_indexers): its top-k would mix requests"
            )
        # The load-time probe's one short sequence: HF's forward over it, causal, with no cache.
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)
        causal = allowed_keys(positions[:, None], positions[None, :], None, None)[None]  # [1, N, N]
        return hf_forward(self, hidden_states, q_resid, position_embeddings, causal, position_ids, None)
    if hidden_states.shape[0] != 1:
        raise RuntimeError(f"a packed step's indexer input is [1, N, H], got {tuple(hidden_states.shape)}")
    with inner_modules_unseen(self, "indexer", self.layer_idx, "once per group of requests"):
        return step.run(self, hf_forward, hidden_states, q_resid, position_embeddings, position_ids)
