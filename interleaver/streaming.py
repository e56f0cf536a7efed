"""HF streamers (`TextStreamer`, `TextIteratorStreamer`, any `put`/`end` object) on nnrun's generations.

HF's `generate` calls `streamer.put(prompt_ids)` (`[B, T_max]`, left-padded) before its first
forward, `streamer.put(tokens)` (`[B]`; a finished row gets the pad token) after each step, and
`streamer.end()` once the generation completes (not when it fails). HF's own streamers take one
prompt: they raise on a batch from that first `put`, so several prompts fail before anything runs.

The engine thread never calls a user's streamer: a slow `put` (a UI, a consumer that blocks)
would stall every request in the engine. The caller's thread, which waits on the generation
anyway, follows its requests' streams and makes HF's calls as each step's tokens arrive. An error
in `put` or `end` ends that generation only (the caller aborts its requests) and reaches the
caller, as HF raises it out of `generate`.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from nnrun.engine import LLM, RequestHandle
from nnrun.outputs import RequestOutput
from nnrun.sampling_params import SamplingParams


class StreamerFeed:
    """Calls one HF streamer as HF's `generate` would, for a generation's requests (in batch order)."""

    def __init__(self, streamer: Any, prompts: Sequence[Sequence[int]], pad_token_id: int) -> None:
        for method in ("put", "end"):
            if not callable(getattr(streamer, method, None)):
                raise TypeError(
                    f"streamer must have put() and end() (an HF BaseStreamer), got {type(streamer).__name__}"
                )
        self.streamer = streamer
        self.prompts = [list(p) for p in prompts]
        self.pad_token_id = pad_token_id

    def begin(self) -> None:
        """The prompt ids, before anything runs."""
        width = max(len(p) for p in self.prompts)
        rows = [[self.pad_token_id] * (width - len(p)) + p for p in self.prompts]
        self.streamer.put(torch.tensor(rows, dtype=torch.int64))  # [B, T_max]

    def follow(self, handles: list[RequestHandle]) -> None:
        """Each step's tokens as soon as every request has sampled them; `end()` if the generation succeeded."""
        streams = [handle.stream() for handle in handles]
        tokens: list[list[int]] = [[] for _ in handles]
        is_finished = [False] * len(handles)
        has_failed = False
        step = 0
        while True:
            for i, handle in enumerate(handles):
                while not is_finished[i] and len(tokens[i]) <= step:
                    output = _next_output(streams[i], handle)
                    if output is None:  # the request failed: HF would have raised out of `generate`
                        is_finished[i] = has_failed = True
                        continue
                    tokens[i] = list(output.outputs[0].token_ids)
                    is_finished[i] = output.finished
            if has_failed or all(len(t) <= step for t in tokens):
                break
            row = [t[step] if len(t) > step else self.pad_token_id for t in tokens]
            self.streamer.put(torch.tensor(row, dtype=torch.int64))  # [B]
            step += 1
        if not has_failed:
            self.streamer.end()


def _next_output(stream: Iterator[RequestOutput], handle: RequestHandle) -> RequestOutput | None:
    """The request's next output, or None if it failed (its error reaches the caller through its result)."""
    try:
        return next(stream)
    except BaseException as error:
        if error is handle.request.error:
            return None
        raise  # the caller's own interrupt


def generate_streamed(
    engine: LLM, prompts: list[list[int]], params: list[SamplingParams], streamer: Any, pad_token_id: int
) -> list[RequestOutput]:
    """`engine.generate(prompts, params)` with `streamer` fed as HF feeds it."""
    feed = StreamerFeed(streamer, prompts, pad_token_id)
    requests = [engine.make_request(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, params))]
    feed.begin()
    handles = engine.submit_requests(requests, stream=True)
    try:
        feed.follow(handles)
        return [handle.result() for handle in handles]
    except BaseException:  # the streamer raised, or Ctrl-C: the requests must not keep running unseen
        engine.abort([req.request_id for req in requests])
        raise
