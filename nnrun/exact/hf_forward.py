"""HFForward: one request's tokens through the model's own HF forward, with the request's own HF cache.

The exact path's model call. Nothing of the engine's packing reaches the model: no attention
backend, no position ids, no packed batch. Each call is what plain HF does for one prompt: the
prefill builds HF's cache object (a `DynamicCache`, Mamba's `cache_params`, RWKV's `state`, ...),
and each decode step feeds it back under the name the model's forward takes. A model that keeps no
cache runs its whole sequence every step, as HF's own generation does with `use_cache=False`.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from nnrun.forward_batch import ForwardBatch, ForwardMode
from nnrun.request import Request

# Where HF models return their cache; each takes it back through the forward argument of the same name.
CACHE_ARGUMENTS = ("past_key_values", "cache_params", "state", "mems", "past_buckets_states")


@dataclass
class RequestCache:
    """A request's HF cache and how many of its tokens it holds."""

    request: Request
    value: Any
    num_tokens: int


class HFForward:
    """Runs one request per call through the unmodified HF forward; keeps each request's HF cache."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        params = inspect.signature(model.forward).parameters
        self.takes = set(params)
        self.cache_argument: str | None = None  # learned from the first forward's output
        self.keeps_cache = True  # until a forward shows the model returns no cache
        self.caches: dict[str, RequestCache] = {}
        self.reason: str | None = None  # why the model runs on the exact path (set by the path choice)
        # A state model's forward may number the tokens after its cache from 0 (Bamba's does): HF's generate
        # passes their positions, and so do we. Others number them from their cache (or as they must: RoBERTa's).
        self.passes_positions = "position_ids" in params and getattr(model, "_is_stateful", False)

    # ---- layout ---------------------------------------------------------------------------
    def forward_batch(self, req: Request, wants_prompt_logits: bool, keeps_all_logits: bool = False) -> ForwardBatch:
        """The one-request batch HF runs next: the uncached tokens, or the whole sequence if nothing is cached."""
        cache = self.caches.get(req.request_id)
        start = cache.num_tokens if cache is not None and cache.num_tokens == req.num_computed_tokens else 0
        if start == 0:
            self.caches.pop(req.request_id, None)
        token_ids = req.all_token_ids[start:]
        num_new = len(token_ids)
        logits_rows = list(range(num_new)) if wants_prompt_logits or keeps_all_logits else [num_new - 1]
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND if num_new > 1 else ForwardMode.DECODE,
            reqs=[req],
            input_ids=torch.tensor(token_ids, dtype=torch.int64),  # [T]
            positions=torch.arange(start, start + num_new, dtype=torch.int64),  # [T]
            out_cache_loc=torch.zeros(0, dtype=torch.int64),  # no paged KV on this path
            extend_seq_lens=[num_new],
            extend_start_loc=[0],
            prefix_lens=[start],
            kv_slots=[],
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),  # [R]
            next_token_logits_rows=[len(logits_rows) - 1],
            prompt_logits_rows=[(0, num_new - 1) if wants_prompt_logits else None],
        )

    # ---- the forward ----------------------------------------------------------------------
    def run(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, type]:
        """The batch's logits rows `[R, V]` and the model's output class."""
        if forward_batch.batch_size != 1:
            raise RuntimeError(f"the exact path runs one request per forward, got {forward_batch.batch_size}")
        req = forward_batch.reqs[0]
        start = forward_batch.prefix_lens[0]
        cache = self.caches.get(req.request_id) if start else None
        if start and (cache is None or cache.num_tokens != start):
            raise RuntimeError(f"request {req.request_id}: no HF cache of its first {start} tokens")
        input_ids = forward_batch.input_ids.to(self.device)[None]  # [1, T]
        logits_indices = forward_batch.logits_indices.to(self.device)  # [R]
        # A request that asked for attention probabilities gets HF's: eager attention returns them.
        wants_probs = bool(forward_batch.attention_probs_rows)
        with attention_implementation(self.model, "eager") if wants_probs else nullcontext():
            output = self.call(input_ids, None if cache is None else cache.value, logits_indices, wants_probs, start)
        logits = output.logits[0]  # [R, V], or [T, V] from a model that ignores logits_to_keep
        if logits.shape[0] != logits_indices.numel():
            logits = logits[logits_indices]
        self._keep_cache(req, output, start + input_ids.shape[1])
        return logits, type(output)

    def call(
        self,
        input_ids: torch.Tensor,
        cache: Any,
        logits_indices: torch.Tensor | None = None,
        output_attentions: bool = False,
        num_cached: int = 0,
        first_position: int = 0,
    ) -> Any:
        """One plain HF forward of `[1, T]` ids after `cache` (None: from the start) of `num_cached` tokens.

        `first_position` numbers the sequence's tokens from there (through `position_ids`: the load-time probe's
        high positions); the cache and masks still hold the sequence's own tokens only.
        """
        kwargs: dict[str, Any] = {"input_ids": input_ids}
        if self.passes_positions or first_position:
            start = first_position + num_cached
            kwargs["position_ids"] = torch.arange(start, start + input_ids.shape[1], device=self.device)[None]
        if output_attentions:
            kwargs["output_attentions"] = True
        if "use_cache" in self.takes:
            kwargs["use_cache"] = self.keeps_cache
        elif "use_mems" in self.takes:
            kwargs["use_mems"] = self.keeps_cache
        if cache is not None:
            kwargs[self.cache_argument] = cache
        if logits_indices is not None and "logits_to_keep" in self.takes:
            kwargs["logits_to_keep"] = logits_indices
        output = self.model(**kwargs)
        if self.cache_argument is None and self.keeps_cache:
            self._learn_cache_argument(output)
        return output

    def _learn_cache_argument(self, output: Any) -> None:
        for argument in CACHE_ARGUMENTS:
            if getattr(output, argument, None) is not None and argument in self.takes:
                self.cache_argument = argument
                return
        self.keeps_cache = False  # HF returned no cache it can take back: every step runs the whole sequence

    def cache_in(self, output: Any) -> Any:
        """The HF cache a forward returned, to pass back on the next one; None if the model keeps none."""
        if not self.keeps_cache or self.cache_argument is None:
            return None
        return getattr(output, self.cache_argument, None)

    def _keep_cache(self, req: Request, output: Any, num_tokens: int) -> None:
        value = self.cache_in(output)
        if value is None:
            self.caches.pop(req.request_id, None)
        else:
            self.caches[req.request_id] = RequestCache(req, value, num_tokens)

    def forget(self, request_ids: list[str]) -> None:
        """Drop finished requests' caches."""
        for request_id in request_ids:
            self.caches.pop(request_id, None)

    def forget_released(self) -> None:
        """Drop the caches of requests the scheduler preempted (it released their pages: nothing is computed)."""
        released = [
            rid
            for rid, cache in self.caches.items()
            if cache.request.num_computed_tokens < cache.num_tokens and not cache.request.page_ids
        ]
        self.forget(released)


def own_attention(model: torch.nn.Module) -> str:
    """The attention implementation HF gives this model by default (sdpa where it can, else eager)."""
    try:
        return model.get_correct_attn_implementation(None)
    except (ValueError, ImportError, AttributeError):
        return "eager"


@contextmanager
def attention_implementation(model: torch.nn.Module, implementation: str) -> Iterator[None]:
    """Within the block the model attends with this HF implementation; the one it had afterwards."""
    current = model.config._attn_implementation
    set_attention(model, implementation)
    try:
        yield
    finally:
        set_attention(model, current)


def set_attention(model: torch.nn.Module, implementation: str) -> None:
    if model.config._attn_implementation != implementation and type(model)._can_set_attn_implementation():
        model.set_attn_implementation(implementation)
