"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (SSE with `stream`).

Each choice is one engine request on the same engine the traces use, so they batch together,
and registered edits (a steering vector, say) apply to them too. A completion takes a list of
prompts, and `n` samples of each (seeded as vLLM seeds them: `openai_protocol.choice_params`);
choice `i` is sample `i % n` of prompt `i // n`. Fields that are not served are refused by name,
and every refusal is in OpenAI's error shape (`openai_errors`). A model without a chat template
sees a chat's messages as their contents joined by newlines. Tokens stream as they are sampled,
each chunk carrying one choice. Streamed or not, a client that disconnects is noticed within
`DISCONNECT_POLL_S` and its requests aborted (their KV pages are freed at the next step); a
registered edit that holds the engine is ended by the server's `EditWatchdog`, and the
completion answered with why.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from nnrun.outputs import RequestOutput
from nnrun.sampling_params import SamplingParams
from nnrun.serve.openai_answer import Answer, echoed_text
from nnrun.serve.openai_errors import OpenAIError, stream_error_event
from nnrun.serve.openai_protocol import ChatRequest, CompletionRequest, SamplingFields, choice_params
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
    return await _complete(request, body, body.prompts(), body.max_tokens or 16, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Any:
    state = request.app.state.serve
    model = state.ready_model()
    prompt = _chat_prompt(model.tokenizer, body.chat_messages())
    max_tokens = body.max_completion_tokens or body.max_tokens or state.config.max_new_tokens
    return await _complete(request, body, [prompt], max_tokens, chat=True)


async def _complete(request: Request, body: SamplingFields, prompts: list[Any], max_tokens: int, chat: bool) -> Any:
    state = request.app.state.serve
    model = state.ready_model()
    if body.model not in (state.config.served_model_name, state.config.model):
        raise OpenAIError(
            404,
            f"the model {body.model!r} does not exist; this server serves {state.config.served_model_name!r}",
            param="model",
            code="model_not_found",
        )
    body.refuse_unserved()
    if max_tokens > state.config.max_new_tokens:
        field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise OpenAIError(
            400,
            f"{field}={max_tokens} is over this server's limit of {state.config.max_new_tokens} new tokens per request",
            param=field,
        )
    try:
        per_choice = choice_params(SamplingParams(max_tokens=max_tokens, **body.sampling_kwargs()), body.n)
    except ValueError as error:
        raise OpenAIError(400, str(error)) from None
    try:
        handles = await asyncio.get_running_loop().run_in_executor(
            state.executor, model.submit_completions, prompts, [per_choice] * len(prompts), body.stream
        )
    except ValueError as error:
        raise OpenAIError(400, str(error), param="messages" if chat else "prompt") from None
    meta = {"id": handles[0].request_id, "created": int(time.time()), "model": body.model}
    deadline = time.monotonic() + state.config.request_timeout_s
    echoes = [echoed_text(model.tokenizer, p) if getattr(body, "echo", False) else None for p in prompts]
    answer = Answer(
        meta, chat, model.tokenizer, body.num_logprobs(), [e for e in echoes for _ in range(body.n)], body.n
    )
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _stream(state, handles, answer, deadline, include_usage), media_type="text/event-stream"
        )
    finals: list[RequestOutput | None] = [None] * len(handles)
    async for index, output in _follow(state, handles, deadline, streamed=False, request=request):
        finals[index] = output
    if any(output is None for output in finals):
        return Response(status_code=499)  # the client left: nobody reads this
    return answer.response(finals)


async def _follow(
    state: Any, handles: list[Any], deadline: float, streamed: bool, request: Request | None = None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice, output) as the choices' outputs come; aborts them if the client leaves, a deadline passes or one fails.

    Streamed, a thread per choice follows its stream (it blocks); otherwise one worker waits for
    each choice's final output. Either hands them to this loop, which looks at the client and the
    deadlines every `DISCONNECT_POLL_S` whether outputs come or not (a generation yields one every
    step, so looking only when none came would never look).
    """
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue = asyncio.Queue()

    def push(index: int, item: Any) -> None:
        loop.call_soon_threadsafe(outputs.put_nowait, (index, item))

    def follow(index: int) -> None:
        try:
            for output in handles[index].stream():
                push(index, output)
        except BaseException as error:  # the request's own failure (a registered edit raised), or its abort
            push(index, error)

    def wait_all() -> None:
        for index, handle in enumerate(handles):
            try:
                push(index, handle.result())
            except BaseException as error:
                push(index, error)

    if streamed:
        for index in range(len(handles)):
            threading.Thread(target=follow, args=(index,), name="nnrun-serve-follow", daemon=True).start()
    else:
        loop.run_in_executor(state.executor, wait_all)
    unfinished = set(range(len(handles)))
    next_look = time.monotonic() + DISCONNECT_POLL_S
    try:
        while unfinished:
            try:
                index, item = await asyncio.wait_for(outputs.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                index, item = None, None
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + DISCONNECT_POLL_S
                state.check_deadlines(deadline)
                if request is not None and await request.is_disconnected():
                    return
            if index is None or index not in unfinished:
                continue
            if isinstance(item, BaseException):
                unfinished.discard(index)
                raise _request_error(state, handles[index], item)
            if item.finished:
                unfinished.discard(index)
            yield index, item
    finally:
        for index in unfinished:
            state.model.abort_completion(handles[index].request_id)


def _request_error(state: Any, handle: Any, error: BaseException) -> OpenAIError:
    """What a failed completion answers: why the server ended its edit, or the request's own error (an edit's)."""
    why = state.model.edit_watchdog.failure(handle.request_id)
    if why is not None:
        return OpenAIError(500, why)
    return OpenAIError(500, f"the request failed: {type(error).__name__}: {error}")


async def _stream(
    state: Any, handles: list[Any], answer: Answer, deadline: float, include_usage: bool = False
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per new piece of a choice's text, then its finish reason; then [DONE].

    A stream that cannot finish (an edit failed, a deadline passed, the server is draining) ends
    with an error event (OpenAI's shape) before [DONE], never cut short without a word. With
    logprobs, each chunk carries those of the tokens it is the first to show; with echo, a
    choice's first chunk shows its prompt first.
    """
    num_choices = answer.num_choices
    sent, num_tokens_sent = [""] * num_choices, [0] * num_choices
    echo_pending = [echo is not None for echo in answer.echoes]
    finals: list[RequestOutput | None] = [None] * num_choices
    if answer.chat:
        for index in range(num_choices):
            yield answer.event({"index": index, "delta": {"role": "assistant"}, "finish_reason": None})
    try:
        async for index, output in _follow(state, handles, deadline, streamed=True):
            completion = output.outputs[0]
            text = completion.text
            delta = ""
            if text.startswith(sent[index]):  # else the text shrank (a stop string trimmed): nothing new
                delta, sent[index] = text[len(sent[index]) :], text
            reason = completion.finish_reason if output.finished else None
            if delta or reason:
                piece = {"delta": {"content": delta}} if answer.chat else {"text": delta}
                logprobs = answer.logprobs(index, completion, num_tokens_sent[index], len(sent[index]) - len(delta))
                if echo_pending[index]:  # the first chunk shows the prompt first
                    piece, logprobs = answer.with_echo(index, output, piece, logprobs)
                    echo_pending[index] = False
                num_tokens_sent[index] = len(completion.token_ids)
                yield answer.event({"index": index, **piece, "finish_reason": reason, **logprobs})
            if output.finished:
                finals[index] = output
        if include_usage:
            yield answer.event(None, usage=answer.usage(finals))
    except Exception as error:
        yield stream_error_event(error)
    yield "data: [DONE]\n\n"


def _chat_prompt(tokenizer: Any, messages: list[dict]) -> str:
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(message["content"] for message in messages)
