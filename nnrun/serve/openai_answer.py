"""How an OpenAI completion is answered: its choices (one per prompt and sample), their logprobs and echo, the usage.

Choice `i` is sample `i % n` of prompt `i // n`, as OpenAI and vLLM number them. The usage counts
each prompt's tokens once however many samples it has, and every choice's generated tokens (vLLM's
count).
"""

from __future__ import annotations

import json
from typing import Any

from nnrun.outputs import RequestOutput
from nnrun.serve.openai_logprobs import chat_logprobs, completion_logprobs, joined


class Answer:
    """One request's answer: its id and model, chat or text, its logprobs if asked for, and what each choice echoes."""

    def __init__(
        self,
        meta: dict,
        chat: bool,
        tokenizer: Any,
        num_logprobs: int | None,
        echoes: list[str | None],
        n: int = 1,
    ) -> None:
        self.meta = meta
        self.chat = chat
        self.echoes = echoes  # per choice: the prompt's text shown before the completion's (`echo=true`), or None
        self.n = n  # samples per prompt
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    @property
    def num_choices(self) -> int:
        return len(self.echoes)

    def event(self, choice: dict | None, **extra: Any) -> str:
        """One SSE chunk: a choice, or (None) none, as the last chunk carrying the usage has it."""
        choices = [choice] if choice is not None else []
        return f"data: {json.dumps({**self.meta, 'object': self.chunk_kind, 'choices': choices, **extra})}\n\n"

    def logprobs(self, index: int, completion: Any, first_token: int = 0, text_offset: int = 0) -> dict:
        """`{"logprobs": ...}` for choice `index`'s tokens from `first_token` on, or {} (chat: not asked for)."""
        if self.num_logprobs is None:
            return {} if self.chat else {"logprobs": None}
        token_ids, entries = completion.token_ids[first_token:], completion.logprobs[first_token:]
        if self.chat:
            return {"logprobs": chat_logprobs(self.tokenizer, token_ids, entries, self.num_logprobs)}
        echo = self.echoes[index]
        if echo is not None:
            text_offset += len(echo)
        return {"logprobs": completion_logprobs(self.tokenizer, token_ids, entries, text_offset)}

    def with_echo(self, index: int, output: RequestOutput, piece: dict, logprobs: dict) -> tuple[dict, dict]:
        """A text piece (and its logprobs) with its prompt's text (and its tokens' logprobs) before it."""
        piece = {"text": self.echoes[index] + piece["text"]}
        if logprobs.get("logprobs") is None:
            return piece, logprobs
        entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        prompt = completion_logprobs(self.tokenizer, output.prompt_token_ids, entries)
        return piece, {"logprobs": joined(prompt, logprobs["logprobs"])}

    def choice(self, index: int, output: RequestOutput) -> dict:
        """Choice `index` of a finished request, as a non-streamed answer shows it."""
        completion = output.outputs[0]
        reason = completion.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": completion.text}
            choice = {"index": index, "message": message, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": index, "text": completion.text, "finish_reason": reason}
        logprobs = self.logprobs(index, completion)
        if self.echoes[index] is not None:
            text, logprobs = self.with_echo(index, output, {"text": completion.text}, logprobs)
            choice.update(text)
        choice.update(logprobs)
        return choice

    def response(self, outputs: list[RequestOutput]) -> dict:
        """The non-streamed answer: every choice, in order, and the usage."""
        return {
            **self.meta,
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": [self.choice(index, output) for index, output in enumerate(outputs)],
            "usage": self.usage(outputs),
        }

    def usage(self, outputs: list[RequestOutput]) -> dict[str, int]:
        """Each prompt's tokens once (its first sample's), and the tokens every choice generated."""
        num_prompt = sum(len(output.prompt_token_ids) for output in outputs[:: self.n])
        num_completion = sum(len(output.outputs[0].token_ids) for output in outputs)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
        }


def echoed_text(tokenizer: Any, prompt: Any) -> str:
    """What `echo=true` shows of the prompt: its text, or the text its token ids decode to."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt) if tokenizer is not None else ""
