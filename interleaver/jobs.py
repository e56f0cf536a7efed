"""The data model of a trace on the engine: a `TraceJob` of `Invocation`s, as the client builds them.

A trace becomes a `TraceJob`. Each invoke of it is an `Invocation`: one mediator (the invoke's
body) over the engine requests of its prompts, in invoke order; an empty invoke spans every
request of the trace. The client builds the job and waits on `job.done`; the runner's
`NNsightRequestHelper` (interleaver/requests.py) drives it on the engine thread. `ParamsBook`
gives the requests their sampling params.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from nnsight.intervention.interleaver import EarlyStopException

from interleaver.mediator import PackedMediator, original_error
from nnrun.request import Request
from nnrun.sampling_params import SamplingParams


@dataclass(eq=False)
class Invocation:
    """One invoke: its mediator and the engine requests it spans, in invoke order."""

    mediator: PackedMediator
    request_ids: list[str]
    index: int  # invoke order within the trace (stored edits, served first, are negative)
    is_edit: bool = False  # a stored `model.edit()` replayed on this trace: its names are not pushed
    job: "TraceJob" = None
    saves: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    warning: str | None = None
    is_started: bool = False
    is_finished: bool = False
    has_streamed_prompt: bool = False  # `model.generator.streamer` has had its first visit (the prompt ids)
    counts_when_out: dict[str, int] | None = None  # interleaver counts when it last sat a step out


@dataclass(eq=False)
class TraceJob:
    """Everything one trace hands the engine, and everything the client waits for."""

    kind: str  # "trace" (one forward) or "generate"
    invocations: list[Invocation]
    needs_grad: bool = False
    pad_token_id: int = 0
    ids_device: torch.device = torch.device("cpu")  # the model's device, where HF's generate puts ids
    seq: int = 0  # submission order across traces
    requests: dict[str, Request] = field(default_factory=dict)  # filled by the client at submit
    client_saves: list[Any] = field(default_factory=list)  # values the trace body saved (its invokes fill them)
    done: threading.Event = field(default_factory=threading.Event)
    results: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> its trace's logits [1, T, V]
    output_type: type = CausalLMOutputWithPast  # the model's own output class, which `tracer.result` is
    # How `tracer.result` is built from an invocation's finished requests; None: HF's forms (`_result_of`).
    make_result: Callable[[list[Request]], Any] | None = None
    streamer: Any = None  # a generation's own HF streamer: the client's thread feeds it (engine never calls it)
    shipped: bytes | None = None  # serialized for tensor-parallel ranks (interleaver/tp_ship.py), else None
    # Inside a session every name the blocks bind goes back to the caller (nnsight pushes them all there);
    # ranks then send every name back, not only the saved ones.
    pushes_every_name: bool = False
    # No block of the trace can touch a step again (each finished, or waits only for the trace's end):
    # its decode steps may run in windows (`NNsightRequestHelper.steps_unwatched`). Never goes back to False.
    is_retired: bool = False

    def __post_init__(self) -> None:
        for invocation in self.invocations:
            invocation.job = self
        self._index: tuple[list[Invocation], dict[str, list[Invocation]]] | None = None

    def invocations_of(self, request_id: str) -> list[Invocation]:
        """The invocations spanning one of this job's requests, in invoke order.

        Indexed once per job (on its first request the engine sees) rather than searched per
        request; rebuilt if `invocations` was replaced since (the serve layer attaches its
        registered edits that way before submitting).
        """
        if self._index is None or self._index[0] is not self.invocations:
            by_request: dict[str, list[Invocation]] = {}
            for invocation in self.invocations:
                for rid in dict.fromkeys(invocation.request_ids):  # an invocation once per request
                    by_request.setdefault(rid, []).append(invocation)
            self._index = (self.invocations, by_request)
        return list(self._index[1].get(request_id, ()))

    @property
    def error(self) -> BaseException | None:
        """The first real error of the trace's blocks or requests (a `stop()` is not one)."""
        for invocation in self.invocations:
            if invocation.error is not None:
                return original_error(invocation.error)
        for request in self.requests.values():
            if request.error is not None and not isinstance(request.error, EarlyStopException):
                return original_error(request.error)
        return None


class ParamsBook:
    """A trace's sampling params: built once per (invoke settings, prompt length), and equal ones are one object.

    Invokes without keywords of their own share the trace's settings, so their params (which depend only on
    the keywords and the prompt's length) are shared. One object for equal params is what `engine.generate`
    gives its prompts: the runner samples a batch whose requests hold one object in whole-batch ops, and a
    batch of several objects row by row.
    """

    def __init__(self, make: Callable[[dict, int], SamplingParams]) -> None:
        self.make = make  # (settings, prompt length) -> params
        self.shared: dict[int, SamplingParams] = {}  # prompt length -> params, for invokes without keywords
        self.distinct: list[SamplingParams] = []

    def for_invoke(self, settings: dict, has_own_settings: bool) -> Callable[[int], SamplingParams]:
        """prompt length -> the params of one invoke's prompt."""
        by_length = {} if has_own_settings else self.shared

        def params_of(prompt_len: int) -> SamplingParams:
            if prompt_len not in by_length:
                made = self.make(settings, prompt_len)
                by_length[prompt_len] = next((known for known in self.distinct if known == made), made)
                if by_length[prompt_len] is made:
                    self.distinct.append(made)
            return by_length[prompt_len]

        return params_of


def pad_sequences(
    sequences: list[list[int]], prompt_lens: list[int], pad_token_id: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Token ids as HF's `generate` returns them: prompts left-padded, completions right-padded, on
    the model's device (HF's are on its input ids' device)."""
    max_prompt = max(prompt_lens)
    max_new = max(len(seq) - n for seq, n in zip(sequences, prompt_lens))
    rows = []
    for seq, n in zip(sequences, prompt_lens):
        new = seq[n:]
        rows.append([pad_token_id] * (max_prompt - n) + seq[:n] + new + [pad_token_id] * (max_new - len(new)))
    return torch.tensor(rows, dtype=torch.int64, device=device)  # [k, T_max + new_max]
