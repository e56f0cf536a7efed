"""Turn input records into token id lists: tokenize in chunks, check vocabulary and length."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from nnrun.extract.inputs import PromptRecord

_TOKENIZE_CHUNK = 256  # records per tokenizer call: a fast tokenizer encodes a list in parallel


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready for the forward: its input index and token ids."""

    index: int
    token_ids: list[int]
    is_truncated: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SkippedPrompt:
    """An input item that cannot be extracted, and why."""

    index: int
    location: str
    reason: str
    line: int | None = None

    def message(self) -> str:
        return f"{self.location}: {self.reason}"

    def to_json(self) -> dict:
        return {"index": self.index, "line": self.line, "reason": self.reason}


@dataclass(frozen=True)
class LengthPolicy:
    """How long a prompt may be and what happens to a longer one."""

    max_length: int  # the user's max_length, or the model's context length
    is_user_limit: bool  # False: max_length is the model's own limit
    truncate: bool = False

    def __post_init__(self) -> None:
        if self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}")


def prepare_prompts(
    records: Iterable[PromptRecord], tokenizer: Any, vocab_size: int, policy: LengthPolicy
) -> Iterator[PreparedPrompt | SkippedPrompt]:
    """Yield one PreparedPrompt or SkippedPrompt per record, in input order."""
    records = iter(records)
    while chunk := list(itertools.islice(records, _TOKENIZE_CHUNK)):
        token_lists = _tokenize_chunk(chunk, tokenizer)
        for record, token_ids in zip(chunk, token_lists):
            yield _check(record, token_ids, vocab_size, policy)


def _tokenize_chunk(chunk: list[PromptRecord], tokenizer: Any) -> list[list[int] | str | None]:
    """Token ids per record (None for bad records, a reason string where tokenizing is impossible)."""
    texts = [(i, r.prompt) for i, r in enumerate(chunk) if isinstance(r.prompt, str)]
    result: list[list[int] | str | None] = [r.prompt if isinstance(r.prompt, list) else None for r in chunk]
    if texts and tokenizer is None:
        for i, _ in texts:
            result[i] = "a text prompt needs a tokenizer; pass tokenizer= or token id lists"
    elif texts:
        try:
            encoded = [list(ids) for ids in tokenizer([text for _, text in texts])["input_ids"]]
        except Exception:
            # One text the tokenizer rejects fails the whole chunk: find it, so that on_error decides about
            # that item alone. Tokenizing alone gives the same ids as in a chunk (no padding, no truncation).
            encoded = [_tokenize_one(text, tokenizer) for _, text in texts]
        for (i, _), token_ids in zip(texts, encoded):
            result[i] = token_ids
    return result


def _tokenize_one(text: str, tokenizer: Any) -> list[int] | str:
    """The text's token ids, or why the tokenizer failed on it."""
    try:
        return list(tokenizer([text])["input_ids"][0])
    except Exception as error:  # any tokenizer's failure on an input is that item's problem, not the job's
        message = f"{type(error).__name__}: {error}".encode("utf-8", "backslashreplace").decode("utf-8")
        return f"the tokenizer failed: {message}"


def _check(
    record: PromptRecord, token_ids: list[int] | str | None, vocab_size: int, policy: LengthPolicy
) -> PreparedPrompt | SkippedPrompt:
    def skip(reason: str) -> SkippedPrompt:
        return SkippedPrompt(record.index, record.location, reason, record.line)

    if record.error is not None:
        return skip(record.error)
    if isinstance(token_ids, str):
        return skip(token_ids)
    if not token_ids:
        return skip("the prompt tokenizes to no tokens")
    out_of_vocab = next((t for t in token_ids if t >= vocab_size), None)
    if out_of_vocab is not None:
        return skip(f"token id {out_of_vocab} is outside the model's vocabulary [0, {vocab_size})")
    if len(token_ids) <= policy.max_length:
        return PreparedPrompt(record.index, token_ids)
    if policy.truncate:
        return PreparedPrompt(record.index, token_ids[: policy.max_length], is_truncated=True)
    limit = "max_length" if policy.is_user_limit else "the model's context length"
    return skip(
        f"the prompt has {len(token_ids)} tokens, more than {limit} {policy.max_length} "
        "(pass truncate=True / --truncate to cut it)"
    )
