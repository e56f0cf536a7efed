"""Sizing and building the runner's KV pool: from the config, or from the GPU memory left after the largest step.

`KVPoolSetup` is the part of `ModelRunner` (nnrun/model_runner.py) that owns this; it reads the
runner's config, layers, dtype, device and `max_model_len`, and sets `kv_pool`, `allocator`,
`max_total_tokens` and `req_to_token_pool`.
"""

from __future__ import annotations

import logging

import torch

from nnrun.forward_batch import ForwardMode
from nnrun.kv_sizing import GiB, kv_budget_bytes, profile_prompt_lengths
from nnrun.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from nnrun.save_budget import saved_values_device_bytes
from nnrun.state.placeholders import kv_shapes

logger = logging.getLogger("nnrun.model_runner")

CPU_KV_BUDGET_BYTES = 2 << 30  # default KV pool on CPU when no size is given


class KVPoolSetup:
    """How many KV pages the runner gets, and the pools built over them."""

    def init_memory_pool(self) -> None:
        cache = self.config.cache
        shapes = kv_shapes(self.layers)
        if cache.num_pages is not None:
            num_pages = cache.num_pages
        elif cache.max_total_tokens is not None:
            num_pages = -(-cache.max_total_tokens // cache.page_size)
        elif not self.layers:  # the exact path: pages only count tokens (HF's own caches hold the values)
            num_pages = -(-self.config.scheduler.max_num_seqs * self.max_model_len // cache.page_size)
        else:
            budget = self._kv_budget_bytes()
            num_pages = max(1, budget // (KVPool.bytes_per_token(shapes, self.dtype) * cache.page_size))
            num_pages = min(num_pages, -(-self.config.scheduler.max_num_seqs * self.max_model_len // cache.page_size))
        self._build_kv_cache(num_pages)

    def _build_kv_cache(self, num_pages: int) -> None:
        page_size = self.config.cache.page_size
        self.kv_pool = KVPool(kv_shapes(self.layers), num_pages, page_size, self.dtype, self.device)
        self.allocator = TokenToKVPoolAllocator(num_pages, page_size)
        self.max_total_tokens = num_pages * page_size
        self.req_to_token_pool = ReqToTokenPool(
            self.config.scheduler.max_num_seqs + 1, min(self.max_model_len, self.max_total_tokens)
        )

    def _kv_budget_bytes(self) -> int:
        if self.device.type != "cuda":
            return CPU_KV_BUDGET_BYTES
        activation_peak = self.profile_activation_peak()
        free, total = torch.cuda.mem_get_info(self.device)
        saved = saved_values_device_bytes(self.config.cache.saved_values_device_bytes, total)
        budget = kv_budget_bytes(total, free, self.config.cache.gpu_memory_utilization, activation_peak, saved)
        logger.info(
            "KV cache budget %.2f GiB (GPU %.2f GiB, %.2f GiB free after loading, largest step %.2f GiB)",
            budget / GiB,
            total / GiB,
            free / GiB,
            activation_peak / GiB,
        )
        return budget

    def profile_activation_peak(self) -> int:
        """Bytes the largest steps the scheduler can build allocate on the GPU beyond the weights.

        Runs those steps once on dummy prompts, over a throwaway KV pool just large enough for them.
        """
        steps = self.profile_steps()
        page_size = self.config.cache.page_size
        self._build_kv_cache(max(sum(-(-n // page_size) for n in lengths) for lengths in steps))
        self.init_attention_backend()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        state_bytes_before = self.state_pool.nbytes if self.state_pool is not None else 0
        try:
            for lengths in steps:
                self.run_dummy_step(lengths)
        except torch.cuda.OutOfMemoryError as error:
            raise ValueError(
                f"the largest step the scheduler may run ({max(map(sum, steps))} tokens) does not fit "
                "on this GPU; lower max_model_len or max_num_batched_tokens"
            ) from error
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        if self.state_pool is not None:  # allocated by these steps and kept: counted as in use, not as activations
            peak -= self.state_pool.nbytes - state_bytes_before
        self.kv_pool = self.allocator = self.req_to_token_pool = self.attn_backend = None
        torch.cuda.empty_cache()
        return peak

    def profile_steps(self) -> list[list[int]]:
        """Prompt lengths of the largest steps: the most requests the token budget holds, and (when it
        is longer than that budget) one prompt of `max_model_len`, which the scheduler runs alone."""
        scheduler = self.config.scheduler
        steps = [profile_prompt_lengths(scheduler.max_num_batched_tokens, self.max_model_len, scheduler.max_num_seqs)]
        if self.max_model_len > scheduler.max_num_batched_tokens:
            steps.append([self.max_model_len])
        return steps

    def run_dummy_step(self, prompt_lengths: list[int]) -> None:
        """One plain prefill step (forward and sampling) of dummy prompts; their KV is freed after."""
        with self._transient_requests([[0] * n for n in prompt_lengths]) as reqs:
            forward_batch = self._prepare_forward_batch(reqs, ForwardMode.EXTEND)
            self.sample(self.packed_step(forward_batch), forward_batch)
