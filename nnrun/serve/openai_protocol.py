"""The OpenAI request bodies this server takes: every field served with OpenAI's meaning, or refused by name.

A field a client sets is never silently ignored when it would change the answer: unknown fields,
wrong types (`stream="yes"`), out-of-range values (`max_tokens=0`) and fields whose OpenAI meaning
is not served (`suffix`, `best_of` above `n`, tools) are answered 400 naming the field, in OpenAI's
error shape with the field as `param` (`openai_errors`). Fields that do not change the answer
(`user`, `metadata`, `store`, `service_tier`) are accepted. vLLM's extra sampling fields (`top_k`,
`min_p`, `min_tokens`, `ignore_eos`, `repetition_penalty`, `stop_token_ids`) are served with vLLM's
meaning, and `logprobs` as OpenAI has it (`openai_logprobs`). A completion's `prompt` may be a list
of prompts, and `n` asks for several samples of each (`choice_params`: seeded as vLLM seeds them).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from nnrun.sampling_params import SEED_RANGE, SamplingParams
from nnrun.serve.openai_errors import OpenAIError

PositiveTokens = Annotated[StrictInt, Field(ge=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
NumLogprobs = Annotated[StrictInt, Field(ge=0, le=20)]  # vLLM's default ceiling (OpenAI's: 5 and 20)
MAX_N = 128  # OpenAI's ceiling on `n`
MAX_CHOICES = 256  # choices per request (prompts x n): each is an engine request, and a stream follows each
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False  # a last chunk with the usage and no choices


class SamplingFields(BaseModel):
    """The fields both routes share."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1  # samples per prompt, each its own choice
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    seed: StrictInt | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    user: StrictStr | None = None  # who asked, for the operator's logs: no effect on the answer
    # vLLM's extensions, with vLLM's meaning
    top_k: Annotated[StrictInt, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    ignore_eos: StrictBool = False
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    stop_token_ids: list[StrictInt] | None = None

    # Fields whose OpenAI meaning this server does not serve: refused unless left at what does nothing.
    unserved: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def num_logprobs(self) -> int | None:
        """How many most likely tokens to answer per generated token (None: no logprobs)."""
        return None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The `SamplingParams` keywords these fields set (max_tokens apart: each route has its default)."""
        kwargs = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "stop",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "top_k",
                "min_p",
                "min_tokens",
                "ignore_eos",
                "repetition_penalty",
                "stop_token_ids",
            )
        }
        return {**kwargs, "logprobs": self.num_logprobs()}

    def refuse_unserved(self) -> None:
        """400 naming the first field set to something this server would not honour."""
        if self.logit_bias:
            raise _refused("logit_bias", self.logit_bias, "token biases are not served")
        if self.stream_options is not None and not self.stream:
            raise _refused("stream_options", self.stream_options.model_dump(), "it is only for stream=true")
        for name, allowed in self.unserved.items():
            value = getattr(self, name)
            if not any(value == a and type(value) is type(a) for a in allowed):
                raise _refused(name, value, "not served by this server")


class CompletionRequest(SamplingFields):
    # One text, one list of token ids, or a list of either: one choice (n choices) per prompt.
    prompt: (
        StrictStr
        | TokenIds
        | Annotated[list[StrictStr], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: PositiveTokens | None = None  # OpenAI's default: 16
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    logprobs: NumLogprobs | None = None

    unserved: ClassVar[dict[str, tuple[Any, ...]]] = {"suffix": (None,)}

    def prompts(self) -> list[Any]:
        """The prompts to complete, each a text or a list of token ids, in the order of their choices."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def refuse_unserved(self) -> None:
        super().refuse_unserved()
        # best_of=n returns every sample, as n does; more would need ranking them, which is not served.
        if self.best_of is not None and self.best_of != self.n:
            raise _refused("best_of", self.best_of, f"only best_of=n ({self.n}) is served: every sample is returned")
        num_choices = len(self.prompts()) * self.n
        if num_choices > MAX_CHOICES:
            raise _refused(
                "n",
                self.n,
                f"{len(self.prompts())} prompts x n={self.n} is {num_choices} choices, over this server's limit of "
                f"{MAX_CHOICES} per request; split the prompts over several requests",
            )

    def sampling_kwargs(self) -> dict[str, Any]:
        # An echoed prompt comes back with its own logprobs when logprobs are asked for.
        return {**super().sampling_kwargs(), "prompt_logprobs": self.logprobs if self.echo else None}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: StrictStr
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Annotated[StrictStr, Field(pattern="^(system|developer|user|assistant)$")]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise _refused("messages.content.type", part.type, "only text parts are served")
        return "".join(part.text for part in self.content)


class ChatRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveTokens | None = None
    max_completion_tokens: PositiveTokens | None = None
    logprobs: StrictBool | None = None
    top_logprobs: NumLogprobs | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    store: StrictBool | None = None  # whether OpenAI keeps the answer: nothing is kept here anyway
    metadata: dict[str, StrictStr] | None = None
    service_tier: StrictStr | None = None
    reasoning_effort: StrictStr | None = None
    modalities: list[StrictStr] | None = None

    unserved: ClassVar[dict[str, tuple[Any, ...]]] = {
        "tools": (None,),
        "tool_choice": (None,),
        "functions": (None,),
        "function_call": (None,),
        "reasoning_effort": (None,),
        "modalities": (None, ["text"]),
    }

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unserved(self) -> None:
        super().refuse_unserved()
        if self.top_logprobs is not None and not self.logprobs:
            raise _refused("top_logprobs", self.top_logprobs, "it needs logprobs=true")
        if self.response_format not in (None, {"type": "text"}):
            raise _refused("response_format", self.response_format, "only plain text is served")

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as a chat template takes them."""
        return [{"role": message.role, "content": message.text()} for message in self.messages]


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling settings of a prompt's `n` choices, seeded as vLLM seeds them.

    vLLM (`ParentRequest`) gives sample j of a request seeded `s` the seed `s + j`: seeded samples
    differ from one another and each is reproducible alone, as `SamplingParams(seed=s + j)`.
    Unseeded samples are each drawn from the engine's own generator, so they differ too.
    """
    if params.seed is None:
        return [params] * n
    if params.seed + n - 1 > SEED_RANGE[1]:
        raise _refused(
            "seed",
            params.seed,
            f"with n={n} the samples are seeded seed..seed+{n - 1} (vLLM's rule), "
            f"past the largest seed, {SEED_RANGE[1]}",
        )
    return [dataclasses.replace(params, seed=params.seed + j) for j in range(n)]


def _refused(name: str, value: Any, why: str) -> OpenAIError:
    return OpenAIError(400, f"{name}={value!r} is refused: {why}", param=name)
