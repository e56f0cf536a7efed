"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# Positive temperatures below this are greedy in all but name (vLLM's _SAMPLING_EPS), and far smaller
# ones turn float32 logits / temperature into inf and NaN: greedy decoding is temperature=0.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


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
        self.max_tokens = _int_field("max_tokens", self.max_tokens, minimum=1, optional=True)
        self.min_tokens = _int_field("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        self.temperature = _float_field("temperature", self.temperature, 0.0, math.inf)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                f"got {self.temperature!r}"
            )
        self.top_p = _float_field("top_p", self.top_p, 0.0, 1.0, is_low_open=True)
        self.top_k = _int_field("top_k", self.top_k, minimum=-1)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float_field("min_p", self.min_p, 0.0, 1.0)
        self.repetition_penalty = _float_field(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, is_low_open=True
        )
        self.frequency_penalty = _float_field("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.presence_penalty = _float_field("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.seed = _int_field("seed", self.seed, minimum=SEED_RANGE[0], maximum=SEED_RANGE[1], optional=True)
        self.logprobs = _int_field("logprobs", self.logprobs, minimum=0, optional=True)
        self.prompt_logprobs = _int_field("prompt_logprobs", self.prompt_logprobs, minimum=0, optional=True)
        self.stop_strings = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # a truthy "false" must not pass as True
                raise ValueError(f"SamplingParams.{name} must be True or False, got {type(value).__name__} {value!r}")

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


def _int_field(
    name: str, value: object, *, minimum: int, maximum: int | None = None, optional: bool = False
) -> int | None:
    """`value` as a Python int in [minimum, maximum]; numpy integers count, bools and floats do not."""
    if value is None and optional:
        return None
    # An exact int passes without the ABC check (bool is a subclass, never the exact type).
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        kind = "an int or None" if optional else "an int"
        raise ValueError(f"SamplingParams.{name} must be {kind}, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"SamplingParams.{name} must be {bounds}, got {value}")
    return value


def _float_field(name: str, value: object, low: float, high: float, *, is_low_open: bool = False) -> float:
    """`value` as a finite Python float in [low, high] ((low, high] when is_low_open); numpy numbers count."""
    is_exact = type(value) is float or type(value) is int  # these pass without the ABC check
    if not is_exact and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ValueError(f"SamplingParams.{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    is_outside = value < low or value > high or (is_low_open and value == low)
    if not math.isfinite(value) or is_outside:  # NaN passes every comparison, so finiteness is checked apart
        interval = f"{'(' if is_low_open else '['}{low:g}, {high:g}{')' if math.isinf(high) else ']'}"
        raise ValueError(f"SamplingParams.{name} must be a finite number in {interval}, got {value!r}")
    return value


def _normalize_stop_token_ids(stop_token_ids: object) -> list[int]:
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, (list, tuple)) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids
    ):
        return [int(t) for t in stop_token_ids]
    raise ValueError(f"SamplingParams.stop_token_ids must be a list of non-negative ints, got {stop_token_ids!r}")
