"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings, named as in vLLM."""

    max_tokens: int | None = 16
    min_tokens: int = 0  # EOS and stop tokens are masked out until this many tokens exist (HF min_new_tokens)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI/vLLM: over output tokens
    presence_penalty: float = 0.0  # OpenAI/vLLM: over output tokens
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs to return per sampled token (0: only the sampled one)
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise ValueError(f"SamplingParams.max_tokens must be a positive int, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"SamplingParams.min_tokens must be a non-negative int, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be 0/-1 (disabled) or a positive int, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"SamplingParams.frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"SamplingParams.presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"SamplingParams.{name} must be a non-negative int or None, got {value!r}")
        self.stop_strings = _normalize_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
        ):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        else:
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise ValueError(f"SamplingParams.stop must be a str or a list of str, got {type(stop).__name__}: {stop!r}")
