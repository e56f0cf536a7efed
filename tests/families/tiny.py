"""Tiny random-weight models of any `model_type` in transformers' causal-LM mapping, built from its config."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

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
    # its first 3 layers are dense by default: one of the two tiny layers routes to experts
    "deepseek_v3": {"first_k_dense_replace": 1},
    # its code reads RoPE settings per layer kind, which its default config leaves empty: here Cohere 2's
    # pattern (RoPE on sliding layers, none on full ones), M-RoPE sections summing to half the head width,
    # and a window the probe's prompts cross
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 50000.0, "mrope_section": [4, 2, 2]},
            "full_attention": None,
        },
    },
    # its attention reads rope_theta from attn_config, which its checkpoints carry beside the config's fields
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "kv_n_heads": 2, "clip_qkv": 8.0}},
}

# Dots 3 Note's text model: DSA layers and sliding-window layers with their own MLA widths (per-layer
# configs its constructor derives from the swa_* arguments, as in its checkpoints).
_DOTS3_TEXT = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "layer_types": ["indexed_attention", "sliding_attention"],
    "num_hidden_layers": 2,
    "mlp_layer_types": ["dense", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": 32,
    "index_topk": 4,  # the 11-token prompt's queries see only the 4 keys their indexer picks
    "index_head_dim": 32,
    "index_n_heads": 4,
    "sliding_window": 8,
    "swa_num_attention_heads": 2,
    "swa_num_key_value_heads": 2,
    "swa_q_lora_rank": 32,
    "swa_kv_lora_rank": 16,
    "swa_head_dim": 40,
    "swa_qk_nope_head_dim": 24,
    "swa_v_head_dim": 16,
    "max_position_embeddings": MAX_POSITIONS,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Qwen4-Exp's text model: gated-delta-net and QSA-indexed attention layers, hyper-connections, and a hashed
# n-gram embedding (PLE) on its linear-attention layer; the QSA fields are unset by default (its
# checkpoints set them) and the n-gram tables default to 20M rows.
_QWEN4_EXP_TEXT = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "layer_types": ["linear_attention", "indexed_attention"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "hc_lowrank": 8,
    "ple_layer_ids": [1],
    "ple_embed_dim": 64,
    "ngram_vocab_size_base": 1000,
    "split_ngram_parts": 1,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 4,  # two blocks of two keys: the 11-token prompt's later queries skip some blocks
    "indexer_compress_ratio": 2,
    "max_position_embeddings": MAX_POSITIONS,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# A Gemma 4 assistant's text model: every layer reads the target model's KV (all layers KV-shared), none
# has per-layer inputs (what its config validates).
_GEMMA4_ASSISTANT_TEXT = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": 8,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "max_position_embeddings": MAX_POSITIONS,
}
_GEMMA4_ASSISTANT = {"backbone_hidden_size": 64, "num_centroids": 16, "centroid_intermediate_top_k": 4}

# Families whose config derives settings from its constructor's arguments (per-layer configs, widths that
# follow others, which layers share a block): built from small arguments, as a checkpoint's config.json
# builds them, instead of shrunk afterwards (which would leave the derived settings at full size).
_CONFIG_ARGUMENTS: dict[str, dict[str, Any]] = {
    "dots3_note_text": _DOTS3_TEXT,
    # the composite validates its adapters' widths against the text model's
    "dots3_note": {
        "text_config": _DOTS3_TEXT,
        "vision_config": {"adapter_out_dim": 64},
        "audio_config": {"adapter_out_dim": 64},
    },
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "qwen4_exp": {"text_config": _QWEN4_EXP_TEXT},
    "gemma4_assistant": {**_GEMMA4_ASSISTANT, "text_config": _GEMMA4_ASSISTANT_TEXT},
    "gemma4_unified_assistant": {
        **_GEMMA4_ASSISTANT,
        "text_config": {**_GEMMA4_ASSISTANT_TEXT, "model_type": "gemma4_unified_text"},
    },
    # one transformer block shared by all hybrid layers (their weights tied to it): it takes two, and its
    # attention widths follow the hidden size (twice it: the hidden states beside the original embeddings)
    "zamba": {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_mamba_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
    },
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
    """The family's config at tiny sizes: a few layers, small widths, a 128-token vocabulary.

    Its default config shrunk, or for a family that derives settings from its arguments, built from
    small arguments (`_CONFIG_ARGUMENTS`).
    """
    if model_type in _CONFIG_ARGUMENTS:
        return AutoConfig.for_model(model_type, **copy.deepcopy(_CONFIG_ARGUMENTS[model_type]))
    config = AutoConfig.for_model(model_type)
    for sub in _configs_of(config):
        _shrink(sub)
    for name, value in _OVERRIDES.get(model_type, {}).items():
        current = getattr(config, name, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):  # fields of a sub-config
            for field, field_value in value.items():
                setattr(current, field, field_value)
            continue
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
        decoder = _decoder_config(config)
        if decoder is None:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._from_config(decoder, dtype=torch.float32)
    return model.eval()


def _decoder_config(config: PretrainedConfig) -> PretrainedConfig | None:
    """The sub-config a composite's causal-LM class is built from, where it is not `text_config`.

    MusicGen maps its composite config to a causal LM whose config class is the composite's
    `decoder`: `AutoModelForCausalLM.from_config` hands a class the `text_config` only, and given the
    composite the class fails (the composite has none of the decoder's fields).
    """
    config_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].config_class
    if isinstance(config, config_class) or "text_config" in (getattr(config, "sub_configs", None) or {}):
        return None
    subs = [getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {}]
    return next((sub for sub in subs if isinstance(sub, config_class)), None)


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
