"""Tiny random-weight models of any `model_type` in transformers' causal-LM mapping, built from its config."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB_SIZE = 128
MAX_POSITIONS = 256

# Config attribute -> the tiny value it gets, when the config has it (names vary by family).
_SIZES = {
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "n_embed": 64,
    "hidden_dim": 64,
    "embed_dim": 64,
    "word_embed_proj_dim": 64,
    "dim": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "d_ff": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "head_dim": 16,
    "kv_channels": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": VOCAB_SIZE,
    "rotary_dim": 8,
    # multi-head latent attention (DeepSeek-style): its head dims and ranks
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    # recurrent and state-space widths that default to the full model's
    "attention_hidden_size": 64,
    "embedding_dim": 64,
}

# Families whose default config leaves a size unset (the hub's checkpoints set it), or whose layer
# kinds follow from a period and offset: values that make a tiny model with one layer of each kind.
_OVERRIDES: dict[str, dict[str, Any]] = {
    "ministral": {"head_dim": 16},
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    "nemotron": {"head_dim": 16, "num_key_value_heads": 2},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "granitemoehybrid": {
        "layer_types": ["linear_attention", "full_attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_n_groups": 1,
        "mamba_d_state": 16,
    },
    "falcon_h1": {"mamba_n_heads": 16, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_ssm": 128, "mamba_d_state": 16},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "attn_layer_indices": [1]},
    "minimax": {"block_size": 4},  # lightning attention's prefill runs in blocks: an 11-token prompt spans three
    # its RG-LRU width follows the full model's hidden size; a window the probe's prompts cross
    "recurrent_gemma": {"lru_width": 64, "attention_window_size": 8},
    # sizes its config derives from the full model's hidden size (attention sees twice the hidden width: the
    # hidden states beside the original embeddings), and the hybrid layer's index in the tiny layer list
    "zamba2": {
        "attention_hidden_size": 128,
        "attention_head_dim": 32,
        "mamba_headdim": 16,
        "mamba_d_state": 16,
        "num_query_groups": 4,
        "hybrid_layer_ids": [1],
        "chunk_size": 8,
    },
    # its block count follows the full model's; its cache rounds the query/key width up to a multiple of 64
    # where its layers do not (the same for the hub's widths)
    "xlstm": {"num_blocks": 2, "qk_dim_factor": 1.0},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": (32, 32), "axial_pos_shape": (16, 16)},
    "deepseek_v2": {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 2},
}
_LAYER_COUNTS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
)
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern")
_TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
    "unk_token_id",
)


def causal_lm_families() -> list[str]:
    """Every `model_type` transformers maps to a causal-LM class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> PretrainedConfig:
    """The family's default config, shrunk to a few layers, small widths and a 128-token vocabulary."""
    config = AutoConfig.for_model(model_type)
    for sub in _configs_of(config):
        _shrink(sub)
    for name, value in _OVERRIDES.get(model_type, {}).items():
        setattr(config, name, value)
        if name in _LAYER_LISTS:
            config.num_hidden_layers = len(value)
    return config


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 causal LM of this family with seeded random weights, in eval mode."""
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _configs_of(config: PretrainedConfig) -> list[PretrainedConfig]:
    subs = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        value = getattr(config, key, None)
        if isinstance(value, PretrainedConfig):
            subs.extend(_configs_of(value))
    return subs


def _shrink(config: PretrainedConfig) -> None:
    for name, value in _SIZES.items():
        _set_if_int(config, name, value)
    heads = getattr(config, "num_attention_heads", 4)
    # Latent attention (DeepSeek-style) expands its keys to every head; elsewhere two KV heads exercise GQA.
    kv_heads = heads if hasattr(config, "kv_lora_rank") else 2 if isinstance(heads, int) and heads % 2 == 0 else 1
    for name in _KV_HEADS:
        _set_if_int(config, name, kv_heads)
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "seq_length"):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) > MAX_POSITIONS:
            setattr(config, name, MAX_POSITIONS)
    num_layers = _shrink_layer_lists(config)
    for name in _LAYER_COUNTS:
        _set_if_int(config, name, num_layers)
    for name in _TOKEN_IDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= VOCAB_SIZE:
            setattr(config, name, VOCAB_SIZE - 1)
        elif isinstance(value, list):
            setattr(config, name, [v if v < VOCAB_SIZE else VOCAB_SIZE - 1 for v in value])


def _shrink_layer_lists(config: PretrainedConfig) -> int:
    """Keep one layer of each kind a per-layer list names (a hybrid keeps its attention and its mixers)."""
    for name in _LAYER_LISTS:
        kinds = getattr(config, name, None)
        if isinstance(kinds, (list, tuple, str)) and kinds and not _is_derived(config, name):
            kept = list(dict.fromkeys(kinds))
            kept = kept * 2 if len(kept) == 1 else kept
            try:
                setattr(config, name, "".join(kept) if isinstance(kinds, str) else kept)
            except AttributeError:  # computed from other fields after all: left to follow them
                continue
            return len(kept)
    return 2


def _is_derived(config: Any, name: str) -> bool:
    """A read-only property computed from other fields (Mamba's `layer_types`): left to follow them."""
    attribute = getattr(type(config), name, None)
    return isinstance(attribute, property) and attribute.fset is None


def _set_if_int(config: Any, name: str, value: int) -> None:
    try:
        current = getattr(config, name, None)
    except Exception:  # a per-layer attribute read globally (Gemma 4): left as it is
        return
    if isinstance(current, int) and not isinstance(current, bool) and current > value and not _is_derived(config, name):
        try:
            setattr(config, name, value)
        except (AttributeError, NotImplementedError):  # a count the family derives from others (ProphetNet's)
            pass
