"""ForwardBatch: the device tensors and per-request layout of one engine step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from nnrun.request import Request

# `Request.extra_args` key: serve this request's attention probabilities as each attention module's
# second output (HF's `output_attentions`); see nnrun/attention/probabilities.py.
OUTPUT_ATTENTIONS_ARG = "output_attentions"


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # at least one request brings more than one new token (a prefill)
    DECODE = "decode"  # every request brings exactly one new token after a cached prefix
    IDLE = "idle"


@dataclass
class ForwardBatch:
    """All new tokens of the scheduled requests, flattened into one `[N]` sequence."""

    forward_mode: ForwardMode
    reqs: list[Request]  # batch order
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, each request's absolute positions (HF position_ids)
    out_cache_loc: torch.Tensor  # [N] int64 KV slot written for each new token
    extend_seq_lens: list[int]  # new tokens per request
    extend_start_loc: list[int]  # first flat index of each request's tokens
    prefix_lens: list[int]  # cached tokens per request before this step
    kv_slots: list[torch.Tensor]  # per request [seq_len] int64 slots of its whole KV after this step
    logits_indices: torch.Tensor  # [R] int64 flat positions whose logits are computed
    next_token_logits_rows: list[int]  # per request, its row in the logits output (None-free: every request samples)
    prompt_logits_rows: list[tuple[int, int] | None] = field(default_factory=list)  # per request [start, end) rows

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def attention_probs_rows(self) -> list[int]:
        """Rows whose requests asked for their attention probabilities."""
        return [row for row, req in enumerate(self.reqs) if req.extra_args.get(OUTPUT_ATTENTIONS_ARG)]

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_seq_lens)]
