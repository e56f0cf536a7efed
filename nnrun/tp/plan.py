"""Load-time checks of a tensor-parallel model: transformers' own plan must exist and divide evenly by N."""

from __future__ import annotations

import math
from typing import Any

# Plan styles that split a dimension across ranks: (what the dimension is, config fields that give its size).
# Only the dimensions a model's plan actually shards are checked.
_SHARDED_DIMENSIONS: list[tuple[tuple[str, ...], str, tuple[str, ...]]] = [
    (("q_proj", "qkv_proj", "query_key_value", "c_attn"), "attention heads", ("num_attention_heads", "n_head")),
    (
        ("k_proj", "v_proj", "qkv_proj", "query_key_value"),
        "KV heads",
        ("num_key_value_heads", "num_attention_heads", "n_head"),
    ),
    (("gate_proj", "up_proj", "gate_up_proj", "fc1", "c_fc"), "MLP width", ("intermediate_size", "n_inner")),
    (("experts",), "expert MLP width", ("moe_intermediate_size", "intermediate_size")),
    (("embed_tokens", "lm_head", "wte"), "vocabulary", ("vocab_size",)),
]
_SPLITTING_STYLES = ("colwise", "rowwise", "embedding", "packed", "moe_tp_experts")


def tensor_parallel_plan(model: Any) -> dict[str, str]:
    """The model's full TP plan as transformers resolves it (`base_model_tp_plan` with the head's own)."""
    return dict(getattr(model, "tp_plan", None) or {})


def check_tensor_parallel_plan(model: Any, tp_size: int) -> None:
    """Refuse a model transformers cannot shard over `tp_size` ranks, saying which dimension and what N would work.

    `model` is the model built on the meta device (its module tree and plan, no weights).
    """
    plan = tensor_parallel_plan(model)
    name = type(model).__name__
    if not plan:
        raise ValueError(
            f"tensor_parallel_size={tp_size}: {name} ({model.config.model_type}) has no tensor-parallel plan in "
            "transformers (`base_model_tp_plan`), so nnrun cannot shard it; run it with tensor_parallel_size=1"
        )
    config = model.config.get_text_config()
    sizes = _sharded_sizes(plan, config)
    bad = [(what, field, size) for what, (field, size) in sizes.items() if size % tp_size]
    if bad:
        what, field, size = bad[0]
        common = math.gcd(*(size for _, size in sizes.values()))
        working = [n for n in range(1, common + 1) if common % n == 0]
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide {name}'s {what} ({field}={size}); sizes that divide "
            f"every dimension its plan shards ({', '.join(f'{f}={s}' for f, s in sizes.values())}): "
            f"{', '.join(map(str, working))}"
        )


def _sharded_sizes(plan: dict[str, str], config: Any) -> dict[str, tuple[str, int]]:
    """What the plan splits -> (the config field that sizes it, its size)."""
    sharded_leaves = {key.rsplit(".", 1)[-1] for key, style in plan.items() if style.startswith(_SPLITTING_STYLES)}
    sizes: dict[str, tuple[str, int]] = {}
    for leaves, what, fields in _SHARDED_DIMENSIONS:
        if not sharded_leaves.intersection(leaves):
            continue
        for field in fields:
            value = getattr(config, field, None)
            if isinstance(value, int) and value > 0:
                sizes[what] = (field, value)
                break
    return sizes
