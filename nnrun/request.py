"""Request: one prompt's life in the engine, from waiting to finished (CPU state only)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from nnrun.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # the request's own code (an intervention) raised


@dataclass(eq=False)
class Request:
    """A prompt and everything the engine tracks about it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)  # opaque to the engine (the nnsight bridge uses it)
    is_preemptible: bool = True
    gang_id: str | None = None  # requests of one gang are admitted in the same step (a trace's invokes)
    arrival_order: int = 0
    is_streamed: bool = False  # a caller reads each new token as it comes: the engine steps it one at a time

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    error: BaseException | None = None

    # KV state: pages in token order, and the row of ReqToTokenPool while running.
    page_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0

    # Outputs gathered on the way.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    generator: torch.Generator | None = None
    text: str | None = None  # final text: cut at a stop string, else decoded when read (StopChecker.final_text)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def fail(self, error: BaseException) -> None:
        """Mark the request as failed by its own code; the engine finishes it after this step."""
        if self.error is None:
            self.error = error
