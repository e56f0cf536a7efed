"""The attention probabilities one packed prefill step serves per layer (HF's `output_attentions`), for tests."""

from __future__ import annotations

from typing import Callable

import torch

import nnrun
from nnrun.forward_batch import OUTPUT_ATTENTIONS_ARG


def packed_attention_probs(
    model: torch.nn.Module, prompts: list[list[int]], attention_of: Callable[[torch.nn.Module], list]
) -> dict:
    """Run `prompts` as one packed prefill asking for probabilities; each attention module's by `layer_idx`.

    `attention_of(model)` picks the attention modules once the engine has loaded (and adapted) the model.
    The values are nnrun's `AttentionProbs` (`.for_row(i)` is prompt i's `[1, H, T, T]`).
    """
    seen: dict = {}
    with nnrun.LLM(model, page_size=4) as llm:
        runner = llm.runner
        attention = attention_of(model)
        assert attention, "no attention module picked"
        reqs = [
            llm.make_request(prompt, nnrun.SamplingParams(max_tokens=1), extra_args={OUTPUT_ATTENTIONS_ARG: True})
            for prompt in prompts
        ]

        def record(module, args, output) -> None:
            seen[module.layer_idx] = output[1]

        handles = [module.register_forward_hook(record) for module in attention]
        try:
            for req in reqs:
                req.page_ids = runner.allocator.alloc(runner.allocator.pages_needed(req.num_tokens))
                req.req_pool_idx = runner.req_to_token_pool.alloc()
            runner.forward(runner.prepare_forward_batch_extend(reqs))
        finally:
            for handle in handles:
                handle.remove()
            for req in reqs:
                runner.release_kv(req)
    return seen
