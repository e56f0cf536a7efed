"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (SSE with `stream`).

Each completion is one engine request on the same engine the traces use, so they batch
together, and registered edits (a steering vector, say) apply to them too. One choice per
request (`n=1`); fields that are not served are refused by name (`openai_protocol`). A model
without a chat template sees a chat's messages as their contents joined by newlines. Tokens
stream as they are sampled. Streamed or not, a client that disconnects is noticed within
`DISCONNECT_POLL_S` and its request aborted (its KV pages are freed at the next step); a
registered edit that holds the engine is ended by the server's `EditWatchdog`, and the
completion answered with why.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response, StreamingResponse

from nnrun.outputs import RequestOutput
from nnrun.sampling_params import SamplingParams
from nnrun.serve.openai_logprobs import chat_logprobs, completion_logprobs, joined
from nnrun.serve.openai_protocol import ChatRequest, CompletionRequest, SamplingFields
from nnrun.serve.state import DISCONNECT_POLL_S

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = request.app.state.serve
    return {
        "object": "list",
        "data": [{"id": state.config.served_model_name, "object": "model", "created": 0, "owned_by": "nnrun"}],
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    return await _complete(request, body, body.prompt, body.max_tokens or 16, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Any:
    state = request.app.state.serve
    model = state.ready_model()
    prompt = _chat_prompt(model.tokenizer, body.chat_messages())
    max_tokens = body.max_completion_tokens or body.max_tokens or state.config.max_new_tokens
    return await _complete(request, body, prompt, max_tokens, chat=True)


async def _complete(request: Request, body: SamplingFields, prompt: Any, max_tokens: int, chat: bool) -> Any:
    state = request.app.state.serve
    model = state.ready_model()
    if body.model not in (state.config.served_model_name, state.config.model):
        raise HTTPException(
            status_code=404,
            detail=f"the model {body.model!r} does not exist; this server serves {state.config.served_model_name!r}",
        )
    body.refuse_unserved()
    try:
        params = SamplingParams(max_tokens=max_tokens, **body.sampling_kwargs())
        handle = await asyncio.get_running_loop().run_in_executor(
            state.executor, model.submit_completion, prompt, params
        )
    except ValueError as error:
        raise HTTPException(status_code=400, detail=str(error)) from None
    meta = {"id": handle.request_id, "created": int(time.time()), "model": body.model}
    deadline = time.monotonic() + state.config.request_timeout_s
    echo = _echoed_text(model.tokenizer, prompt) if getattr(body, "echo", False) else None
    answer = _Answer(meta, chat, model.tokenizer, body.num_logprobs(), echo)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _stream(state, handle, answer, deadline, include_usage), media_type="text/event-stream"
        )
    last = None
    async for last in _outputs(state, handle, deadline, request):
        pass
    if last is None or not last.finished:
        return Response(status_code=499)  # the client left: nobody reads this
    return answer.response(last)


async def _outputs(
    state: Any, handle: Any, deadline: float, request: Request | None = None
) -> AsyncIterator[RequestOutput]:
    """The request's outputs as they come; aborts it if the client leaves, a deadline passes or a drain cuts it.

    A worker thread follows the engine's stream (it blocks) and hands each output to this loop.
    The client and the deadlines are looked at every `DISCONNECT_POLL_S` whether outputs come or
    not (a generation yields one every step, so looking only when none came would never look).
    """
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue = asyncio.Queue()

    def follow() -> None:
        try:
            for output in handle.stream():
                loop.call_soon_threadsafe(outputs.put_nowait, output)
        except BaseException as error:  # the request's own failure (a registered edit raised), or its abort
            loop.call_soon_threadsafe(outputs.put_nowait, error)

    loop.run_in_executor(state.executor, follow)
    finished = False
    next_look = time.monotonic() + DISCONNECT_POLL_S
    try:
        while not finished:
            try:
                item = await asyncio.wait_for(outputs.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                item = None
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + DISCONNECT_POLL_S
                state.check_deadlines(deadline)
                if request is not None and await request.is_disconnected():
                    return
            if item is None:
                continue
            if isinstance(item, BaseException):
                finished = True
                raise _request_error(state, handle, item)
            finished = item.finished
            yield item
    finally:
        if not finished:
            state.model.abort_completion(handle.request_id)


def _request_error(state: Any, handle: Any, error: BaseException) -> HTTPException:
    """What a failed completion answers: why the server ended its edit, or the request's own error (an edit's)."""
    why = state.model.edit_watchdog.failure(handle.request_id)
    if why is not None:
        return HTTPException(status_code=500, detail=why)
    return HTTPException(status_code=500, detail=f"the request failed: {type(error).__name__}: {error}")


async def _stream(
    state: Any, handle: Any, answer: "_Answer", deadline: float, include_usage: bool = False
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per new piece of text, then the finish reason, then [DONE].

    A stream that cannot finish (an edit failed, a deadline passed, the server is draining) ends
    with an error event before [DONE], never cut short without a word. With logprobs, each chunk
    carries those of the tokens it is the first to show.
    """
    sent, num_tokens_sent, echo_pending = "", 0, answer.echo is not None
    if answer.chat:
        yield answer.event({"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})
    try:
        async for output in _outputs(state, handle, deadline):
            completion = output.outputs[0]
            text = completion.text
            delta, sent = (text[len(sent) :], text) if text.startswith(sent) else ("", sent)
            reason = completion.finish_reason if output.finished else None
            if delta or reason:
                piece = {"delta": {"content": delta}} if answer.chat else {"text": delta}
                logprobs = answer.logprobs(completion, num_tokens_sent, len(sent) - len(delta))
                if echo_pending:  # the first chunk shows the prompt first
                    piece, logprobs = answer.with_echo(output, piece, logprobs)
                    echo_pending = False
                num_tokens_sent = len(completion.token_ids)
                yield answer.event({"index": 0, **piece, "finish_reason": reason, **logprobs})
            if output.finished and include_usage:
                yield answer.event(None, usage=_usage(output))
    except Exception as error:
        detail = error.detail if isinstance(error, HTTPException) else f"{type(error).__name__}: {error}"
        yield f"data: {json.dumps({'error': {'message': detail}})}\n\n"
    yield "data: [DONE]\n\n"


class _Answer:
    """How one completion is answered: its id and model, chat or text, and its logprobs if asked for."""

    def __init__(
        self, meta: dict, chat: bool, tokenizer: Any, num_logprobs: int | None, echo: str | None = None
    ) -> None:
        self.meta = meta
        self.chat = chat
        self.echo = echo  # the prompt's text, shown before the completion's (`echo=true`)
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def event(self, choice: dict | None, **extra: Any) -> str:
        """One SSE chunk: a choice, or (None) none, as the last chunk carrying the usage has it."""
        choices = [choice] if choice is not None else []
        return f"data: {json.dumps({**self.meta, 'object': self.chunk_kind, 'choices': choices, **extra})}\n\n"

    def logprobs(self, completion: Any, first_token: int = 0, text_offset: int = 0) -> dict:
        """`{"logprobs": ...}` for the completion's tokens from `first_token` on, or {} (chat: not asked for)."""
        if self.num_logprobs is None:
            return {} if self.chat else {"logprobs": None}
        token_ids, entries = completion.token_ids[first_token:], completion.logprobs[first_token:]
        if self.chat:
            return {"logprobs": chat_logprobs(self.tokenizer, token_ids, entries, self.num_logprobs)}
        if self.echo is not None:
            text_offset += len(self.echo)
        return {"logprobs": completion_logprobs(self.tokenizer, token_ids, entries, text_offset)}

    def with_echo(self, output: RequestOutput, piece: dict, logprobs: dict) -> tuple[dict, dict]:
        """A text piece (and its logprobs) with the prompt's text (and its tokens' logprobs) before it."""
        piece = {"text": self.echo + piece["text"]}
        if logprobs.get("logprobs") is None:
            return piece, logprobs
        entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        prompt = completion_logprobs(self.tokenizer, output.prompt_token_ids, entries)
        return piece, {"logprobs": joined(prompt, logprobs["logprobs"])}

    def response(self, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        reason = completion.finish_reason
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": completion.text},
                "finish_reason": reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": completion.text, "finish_reason": reason}
        logprobs = self.logprobs(completion)
        if self.echo is not None:
            text, logprobs = self.with_echo(output, {"text": completion.text}, logprobs)
            choice.update(text)
        choice.update(logprobs)
        return {
            **self.meta,
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": [choice],
            "usage": _usage(output),
        }


def _usage(output: RequestOutput) -> dict[str, int]:
    num_prompt, num_completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


def _echoed_text(tokenizer: Any, prompt: Any) -> str:
    """What `echo=true` shows of the prompt: its text, or the text its token ids decode to."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt) if tokenizer is not None else ""


def _chat_prompt(tokenizer: Any, messages: list[dict]) -> str:
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(message["content"] for message in messages)
