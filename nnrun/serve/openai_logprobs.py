"""Log-probabilities in OpenAI's two shapes, from the engine's per-token `{token_id: logprob}` entries.

The engine's entry for a generated token holds the `k` most likely tokens and the sampled one
(`SamplingParams(logprobs=k)`, vLLM's meaning): `logprobs=0` gives the sampled token's alone.
Completions answer as OpenAI's legacy API does (`tokens`, `token_logprobs`, `top_logprobs` as
{text: logprob}, `text_offset` counted from the completion's start, as vLLM counts without echo);
chat as its `logprobs.content` list, whose `top_logprobs` are the `k` most likely tokens.
"""

from __future__ import annotations

from typing import Any


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], entries: list[dict[int, float] | None], text_offset: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy `logprobs`; an entry of None (an echoed prompt's first token, which nothing predicts) is null."""
    texts = [_text(tokenizer, token_id) for token_id in token_ids]
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [entry[tid] if entry is not None else None for tid, entry in zip(token_ids, entries)],
        "top_logprobs": [
            {_text(tokenizer, tid): lp for tid, lp in entry.items()} if entry is not None else None for entry in entries
        ],
        "text_offset": offsets,
    }


def joined(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    """Two legacy `logprobs` one after the other (an echoed prompt's, then its completion's)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]], num_top: int
) -> dict[str, Any]:
    return {
        "content": [
            {
                **_token(tokenizer, token_id, entry[token_id]),
                "top_logprobs": [_token(tokenizer, tid, lp) for tid, lp in _most_likely(entry, num_top)],
            }
            for token_id, entry in zip(token_ids, entries)
        ]
    }


def _most_likely(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:num_top]


def _token(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = _text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
