"""Load-time probe: run two tokens through the model and record what each attention layer needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nnrun.attention.base import AttentionBackend
from nnrun.attention.context import forward_context
from nnrun.attention.indexer import unserved_indexers
from nnrun.attention.score_terms import ScoreTerms
from nnrun.memory import LayerKVShape


@dataclass(frozen=True)
class AttentionLayerInfo:
    """One attention layer as the model actually calls it."""

    layer_idx: int
    num_q_heads: int
    kv_shape: LayerKVShape
    scaling: float
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool = False  # a per-head sink logit joins the softmax (gpt-oss, Granite SWA)
    chunk_size: int | None = None  # chunked attention (Llama 4): a query sees only keys of its own chunk
    # ALiBi (Bloom, MPT, Falcon): per query head, `slope * (key_pos - query_pos)` joins each scaled score
    alibi_slopes: tuple[float, ...] | None = None
    has_key_indices: bool = False  # DSA sparse attention: each query sees only the keys its indexer picked
    has_relative_logits: bool = False  # Inkling: a logit per query and key distance joins each score

    @property
    def has_alibi(self) -> bool:
        return self.alibi_slopes is not None


class _ProbeBackend(AttentionBackend):
    """Records each attention call; returns zeros (the probe's outputs are never used)."""

    name = "probe"

    def __init__(self) -> None:
        self.calls: list[AttentionLayerInfo] = []

    def init_forward_metadata(self, forward_batch) -> None:
        pass

    def forward(self, layer_idx, q, k, v, terms: ScoreTerms):
        shape = LayerKVShape(num_kv_heads=k.shape[1], head_dim=k.shape[2], v_head_dim=v.shape[2])
        self.calls.append(
            AttentionLayerInfo(
                layer_idx,
                q.shape[1],
                shape,
                terms.scaling,
                terms.sliding_window,
                terms.softcap,
                terms.sinks is not None,
                terms.chunk_size,
                None if terms.alibi_slopes is None else tuple(terms.alibi_slopes.float().tolist()),
                terms.key_indices is not None,
                terms.relative_logits is not None,
            )
        )
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))


def probe_attention_layers(
    model: torch.nn.Module, device: torch.device, kv_free_layer_ids: frozenset[int] = frozenset()
) -> list[AttentionLayerInfo]:
    """Per-layer K/V shapes, scale, window and softcap, indexed by `module.layer_idx`.

    Layers in `kv_free_layer_ids` (a hybrid's mixers, which the state pool serves, and its
    feed-forward-only layers) call no attention by design.
    """
    refuse_sparse_attention_indexers(model)
    probe = _ProbeBackend()
    pad_id = getattr(model.config, "pad_token_id", None)
    token_id = 1 if pad_id == 0 else 0  # a pad token would make some models warn about missing masks
    input_ids = torch.full((1, 2), token_id, dtype=torch.int64, device=device)  # [1, 2]
    positions = torch.arange(2, device=device)[None]  # [1, 2]
    with forward_context(probe), torch.no_grad():
        model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=1)
    layer_ids = [call.layer_idx for call in probe.calls]
    if not all(isinstance(layer_idx, int) for layer_idx in layer_ids):
        raise ValueError(
            "an attention module has no layer index of its own (layer_idx=None: one attention block shared by "
            "several layers, each passing its own cache index at call time, as Zamba's): the packed path pages "
            "one KV cache per attention module's layer_idx"
        )
    served = sorted(set(layer_ids) | kv_free_layer_ids)
    if len(set(layer_ids)) != len(layer_ids) or served != list(range(len(served))):
        raise ValueError(f"the packed path pages one KV cache per attention call: {_layer_mismatch(layer_ids)}")
    for call in probe.calls:
        if call.num_q_heads % call.kv_shape.num_kv_heads:
            raise ValueError(
                f"layer {call.layer_idx}: {call.num_q_heads} query heads are not a multiple of "
                f"{call.kv_shape.num_kv_heads} KV heads"
            )
    return sorted(probe.calls, key=lambda call: call.layer_idx)


def refuse_sparse_attention_indexers(model: torch.nn.Module) -> None:
    """Sparse attention the packed path cannot serve, refused by name.

    DSA indexers (DeepSeek-V3.2's and its kin) run per request (nnrun/attention/indexer, adapted at
    load). Any other indexer picks keys its own way, by scoring blocks of keys: DeepSeek-V4's blocks
    are built by a compressor whose state is carried between forwards, which no packed step keeps;
    Qwen4-Exp's QSA averages its own keys in blocks, query by query, and picks whole blocks.
    """
    unserved = unserved_indexers(model)
    if unserved:
        raise ValueError(
            f"{unserved[0]} is a sparse-attention indexer that does not pick from per-token keys of its own "
            "(it scores compressed key blocks: DeepSeek-V4's with compressor state kept between forwards, "
            "Qwen4-Exp's QSA pooled per query from its own keys), which the packed path does not run"
        )


def _layer_mismatch(layer_ids: list[int]) -> str:
    """Why attention calls reporting these `layer_idx` values cannot each own a KV cache, in a user's words."""
    repeated = sorted({i for i in layer_ids if layer_ids.count(i) > 1})
    missing = sorted(set(range(max(layer_ids, default=-1) + 1)) - set(layer_ids))
    if repeated:
        return (
            f"layers {repeated} call attention more than once per forward (shared-KV or repeated attention "
            f"layers report layer_idx {layer_ids})"
        )
    return (
        f"layers {missing} do not call transformers' attention interface (state-space, linear-attention or "
        f"other mixer layers beside attention layers {layer_ids})"
    )
