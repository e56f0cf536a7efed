"""RequestOutput and CompletionOutput, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nnrun.request import Request


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    extra_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_request(cls, req: Request, text: str) -> "RequestOutput":
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason.value if req.finish_reason is not None else None,
            stop_reason=req.stop_reason,
            logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
        )
        return cls(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=req.prompt_logprobs,
            outputs=[completion],
            finished=req.is_finished,
            extra_args=req.extra_args,
        )
