"""Small random-weight models of each supported family, and their plain-HF twins as oracles."""

from __future__ import annotations

import copy

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _configs() -> dict:
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**_COMMON)),
        # layer 1 slides with a window shorter than most prompts, so a missing window shows.
        "qwen2": (
            Qwen2ForCausalLM,
            Qwen2Config(
                **_COMMON,
                use_sliding_window=True,
                sliding_window=16,
                max_window_layers=1,
                layer_types=["full_attention", "sliding_attention"],
            ),
        ),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**_COMMON, head_dim=16)),
        "mistral": (MistralForCausalLM, MistralConfig(**_COMMON, sliding_window=24)),
        "gpt2": (
            GPT2LMHeadModel,
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=512,
                bos_token_id=0,
                eos_token_id=0,
                scale_attn_by_inverse_layer_idx=True,
            ),
        ),
        "gpt_neox": (
            GPTNeoXForCausalLM,
            GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=512,
            ),
        ),
        # a small softcap binds at random-init logit sizes; window 16 on the sliding layer.
        "gemma2": (
            Gemma2ForCausalLM,
            Gemma2Config(
                **_COMMON,
                head_dim=16,
                sliding_window=16,
                attn_logit_softcapping=0.5,
                final_logit_softcapping=3.0,
                query_pre_attn_scalar=24,
            ),
        ),
        # sliding and full layers with different RoPE bases, q/k norms.
        "gemma3": (
            Gemma3ForCausalLM,
            Gemma3TextConfig(
                **_COMMON, head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"]
            ),
        ),
        "phi3": (Phi3ForCausalLM, Phi3Config(**_COMMON, sliding_window=24, pad_token_id=0)),
        "olmo2": (Olmo2ForCausalLM, Olmo2Config(**_COMMON)),
    }


FAMILIES = list(_configs())


def make_model(family: str, seed: int = 0) -> torch.nn.Module:
    model_cls, config = _configs()[family]
    torch.manual_seed(seed)
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    return model_cls(config).eval()


def make_twin(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy with eager attention: the oracle the engine is compared with."""
    twin = type(model)(copy.deepcopy(model.config)).eval()
    twin.load_state_dict(model.state_dict())
    twin.set_attn_implementation("eager")
    return twin


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of one prompt run alone through the plain HF model."""
    return model(torch.tensor([token_ids])).logits[0].float()
