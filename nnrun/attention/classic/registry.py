"""Which attention module classes have a classic adapter, and the pass that applies them to a model."""

from __future__ import annotations

from typing import Callable

import torch

from nnrun.attention.classic import attn_method, bloom, diffllama, falcon, inkling, mpt, xglm
from nnrun.attention.hf_glue import MASK_FREE_UNDER_OUR_NAME

_MODELS = "transformers.models"
# The exact HF class (its module path and name) -> what adapts an instance. Subclasses (the flash
# variants) are not adapted: they stay off the interface, and the probe sends them to the exact path.
ADAPTERS: dict[str, Callable[[torch.nn.Module], None]] = {
    f"{_MODELS}.gptj.modeling_gptj.GPTJAttention": attn_method.install(attn_method.GPTJ),
    f"{_MODELS}.codegen.modeling_codegen.CodeGenAttention": attn_method.install(attn_method.CODEGEN),
    f"{_MODELS}.gpt_neo.modeling_gpt_neo.GPTNeoSelfAttention": attn_method.install(attn_method.GPT_NEO),
    f"{_MODELS}.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention": attn_method.install(
        attn_method.GPT_NEOX_JAPANESE
    ),
    f"{_MODELS}.bloom.modeling_bloom.BloomAttention": bloom.adapt,
    f"{_MODELS}.falcon.modeling_falcon.FalconAttention": falcon.adapt,
    f"{_MODELS}.mpt.modeling_mpt.MptAttention": mpt.adapt,
    f"{_MODELS}.openai.modeling_openai.Attention": attn_method.install(attn_method.OPENAI_GPT),
    f"{_MODELS}.xglm.modeling_xglm.XGLMAttention": xglm.adapt,
    f"{_MODELS}.inkling.modeling_inkling.InklingAttention": inkling.adapt_inkling,
    f"{_MODELS}.inkling2.modeling_inkling2.Inkling2SlidingAttention": inkling.adapt_inkling2,
    f"{_MODELS}.inkling2.modeling_inkling2.Inkling2FullAttention": inkling.adapt_inkling2,
    f"{_MODELS}.diffllama.modeling_diffllama.DiffLlamaAttention": diffllama.adapt,
}
_ADAPTED = "_nnrun_classic_attention"  # set on an adapted module: the pass runs once per module
# Families whose model forward needs the mask HF builds under its own implementation name (MPT calls
# `.to(torch.bool)` on it): their steps build it, and their adapted attention ignores it.
_NEED_THEIR_MASK = {f"{_MODELS}.mpt.modeling_mpt.MptAttention"}


def adapt_classic_attention(model: torch.nn.Module) -> list[str]:
    """Route every classic attention module of `model` through the paged attention; returns their paths (idempotent)."""
    adapted, need_their_mask = [], False
    for path, module in model.named_modules():
        name = f"{type(module).__module__}.{type(module).__qualname__}"
        adapter = ADAPTERS.get(name)
        if adapter is None:
            continue
        need_their_mask |= name in _NEED_THEIR_MASK
        if not module.__dict__.get(_ADAPTED, False):
            adapter(module)
            module.__dict__[_ADAPTED] = True
            if getattr(module, "layer_idx", None) is None:  # HF numbers no layers (OpenAI GPT): in model order
                module.layer_idx = len(adapted)
        adapted.append(path)
    if adapted and not need_their_mask:  # steps skip HF's mask, which the adapted attention never reads
        model.__dict__[MASK_FREE_UNDER_OUR_NAME] = True
    return adapted
