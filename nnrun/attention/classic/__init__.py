"""Classic families whose attention is their own code, routed through the engine's paged attention.

GPT-J, GPT-Neo, CodeGen, GPT-NeoX-Japanese, Bloom, Falcon, MPT and OpenAI GPT never call transformers'
attention interface: their modules compute scores, mask, softmax and the weighted sum themselves.
A pass over the built model (`adapt_classic_attention`) replaces, on each such module instance,
only that core: inside an engine step it goes through `paged_attention_forward` (the backend, the
paged KV cache, attention probabilities when asked), while the module's own projections, rotary,
head splitting and output projection still run as HF's code, so every submodule hook fires with
HF's values. Outside a step (a plain call, the exact path, HF's reference forwards) the module is
HF's own. The load-time probe (`nnrun/exact/probe.py`) still judges the result.

XGLM's attention is its own code too. Two families call the interface in ways a paged step cannot
take as they are, and are adapted here the same way: DiffLlama calls it twice per layer over one
query and key (one call over both values serves both), and Inkling's layers hand it a dense relative
position bias built at positions HF numbers itself (their relative-logits module gives the per-query
logits by distance instead, which the backend applies per request).
"""

from nnrun.attention.classic.registry import adapt_classic_attention

__all__ = ["adapt_classic_attention"]
