"""LLM: the user-facing engine (vLLM's API), serving callers from any thread."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from nnrun.config import EngineConfig
from nnrun.engine_core import EngineCore
from nnrun.lifecycle import stop_at_exit
from nnrun.model_runner import ModelRunner
from nnrun.model_source import as_model_source
from nnrun.outputs import RequestOutput
from nnrun.prompts import split_prompts, tokenize_prompt
from nnrun.request import Request
from nnrun.sampling_params import SamplingParams

Prompt = str | Sequence[int] | dict  # a vLLM TextPrompt or TokensPrompt dict too
logger = logging.getLogger(__name__)


class RequestHandle:
    """The caller's side of one request: wait for its output, or stream it.

    A finished request's output (and its text) is built when `result()` first asks for it, on the
    caller's thread: many callers (a trace's requests) never ask, and detokenizing is not free.
    """

    def __init__(self, request: Request, stream: bool, text_of: Callable[[Request], str]) -> None:
        self.request = request
        self.request_id = request.request_id
        self._text_of = text_of  # a finished request's final text
        self._done = threading.Event()
        self._stream: queue.Queue | None = queue.Queue() if stream else None
        self._output: RequestOutput | None = None

    def _publish(self, output: RequestOutput) -> None:
        """A streamed output (the engine thread calls this only for a streaming handle)."""
        self._stream.put(output)
        if output.finished:
            self._output = output

    def _finish(self) -> None:
        self._done.set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; raises the request's error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.request.error is not None:
            raise self.request.error
        if self._output is None:  # a finished request no longer changes: build its output once, now
            self._output = RequestOutput.from_request(self.request, self._text_of(self.request))
        return self._output

    def stream(self) -> Iterator[RequestOutput]:
        """Outputs as tokens are produced, ending with the finished one."""
        if self._stream is None:
            raise RuntimeError("submit(..., stream=True) to stream a request")
        while True:
            output = self._stream.get()
            if self.request.error is not None and output.finished:
                raise self.request.error
            yield output
            if output.finished:
                return


class LLM:
    """A continuous-batching engine over an unmodified HF model.

    `LLM(model, tokenizer=None, device="cpu", dtype=None, **engine_kwargs)`: `model` is a
    `PreTrainedModel`, a checkpoint folder, a hub id, a bundled name such as "tiny-facts", or an
    `LLM`/`LanguageModel` whose model (in memory) a new engine serves;
    engine keywords are the fields of the config dataclasses (page_size, max_total_tokens,
    max_num_seqs, max_num_batched_tokens, max_model_len, load_format, ...). `tensor_parallel_size=N`
    runs the model on N rank processes that each hold a shard of every layer (`nnrun.tp`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        device: str = "cpu",
        dtype: Any = None,
        runner_cls: type[ModelRunner] = ModelRunner,
        **engine_kwargs: Any,
    ) -> None:
        model, tokenizer = as_model_source(model, tokenizer)  # an engine or LanguageModel: its model
        self.config = EngineConfig.from_kwargs(model, tokenizer, device=device, dtype=dtype, **engine_kwargs)
        if self.config.parallel.tensor_parallel_size > 1:  # the weights live on rank processes (nnrun.tp)
            from nnrun.tp import tensor_parallel_runner_class

            runner_cls = tensor_parallel_runner_class(runner_cls)
        self.runner = runner_cls(self.config)
        self.runner.initialize()
        self.model = self.runner.model
        self.tokenizer = self.runner.tokenizer
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.runner.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.core = EngineCore(self.runner, self.runner.eos_token_ids)
        self._ids = itertools.count()
        self._arrivals = itertools.count(1)
        self._handles: dict[str, RequestHandle] = {}
        self._inbox: list[Request] = []
        self._aborts: dict[str, BaseException] = {}  # request id -> the error its caller gets
        self._wakeup = threading.Condition()
        self._stopping = False
        self._num_pauses = 0  # > 0 while a caller holds the engine between steps (`paused()`)
        self._num_streams = 0  # streaming handles not yet finished (guarded by `_wakeup`)
        self._thread: threading.Thread | None = None
        stop_at_exit(self)  # a daemon engine thread still running at finalization aborts the process

    # ---- public API -----------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order."""
        prompt_list = split_prompts(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        requests = [self.make_request(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompt_list, params_list))]
        handles = self.submit_requests(requests)
        try:
            if use_tqdm:
                from tqdm import tqdm

                return [handle.result() for handle in tqdm(handles, desc="generate")]
            return [handle.result() for handle in handles]
        except BaseException:  # Ctrl-C while waiting: the requests must not keep running unseen
            self.abort([req.request_id for req in requests])
            raise

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput after every new token of one prompt."""
        return self.submit(prompt, sampling_params, stream=True).stream()

    def submit(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        extra_args: dict | None = None,
        preemptible: bool = True,
        stream: bool = False,
    ) -> RequestHandle:
        """Queue one request (thread-safe) and return its handle."""
        req = self.make_request(
            prompt,
            sampling_params or SamplingParams(),
            request_id=request_id,
            extra_args=extra_args,
            preemptible=preemptible,
        )
        return self.submit_requests([req], stream=stream)[0]

    def submit_requests(
        self, requests: list[Request], *, gang: bool = False, stream: bool = False
    ) -> list[RequestHandle]:
        """Queue requests made by `make_request` atomically (thread-safe).

        With `gang=True` the scheduler admits them in the same step, all or none (as long as they
        fit `max_num_seqs`), which interventions that share values across requests rely on.
        """
        if gang and len(requests) > 1:
            self._check_gang_fits(requests)
            for req in requests:
                req.gang_id = requests[0].request_id
        return self._enqueue(requests, stream)

    def _check_gang_fits(self, requests: list[Request]) -> None:
        """A gang runs in one step or not at all: refuse one that no step can hold, rather than split it."""
        max_num_seqs = self.config.scheduler.max_num_seqs
        if len(requests) > max_num_seqs:
            raise ValueError(
                f"a trace of {len(requests)} prompts cannot run: its prompts must share one forward, and the engine "
                f"runs at most max_num_seqs={max_num_seqs} requests per step. Split the prompts over several "
                f"traces, or build the model with max_num_seqs >= {len(requests)}"
            )
        num_slots = sum(self.runner.allocator.pages_needed(req.num_tokens) for req in requests)
        num_slots *= self.runner.allocator.page_size
        if num_slots > self.runner.max_total_tokens:
            raise ValueError(
                f"a trace of {len(requests)} prompts needs {num_slots} KV slots in one step, but the KV pool holds "
                f"{self.runner.max_total_tokens}; split the prompts over several traces, or give the engine a "
                "larger pool (max_total_tokens)"
            )

    @property
    def num_requests_in_flight(self) -> int:
        """Requests submitted and not yet finished (thread-safe)."""
        with self._wakeup:
            return len(self._handles)

    def request_ids_in_flight(self) -> list[str]:
        """The ids of the requests submitted and not yet finished (thread-safe; a snapshot)."""
        with self._wakeup:
            return list(self._handles)

    @property
    def engine_thread(self) -> threading.Thread | None:
        """The thread that runs the engine's steps (None until the first request starts it)."""
        return self._thread

    def step_counters(self) -> dict[str, int]:
        """Running totals of the engine's forwards (`StepCounters`): a snapshot, read without stopping it."""
        return self.core.counters.snapshot()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between steps: requests submitted meanwhile enter the same next step.

        The step running when this is entered completes first (a multi-step window, all its decode
        steps: `num_scheduler_steps`). Used to co-schedule requests on
        purpose (tests of isolation, fair batching by a server). Never wait on a request inside
        the `with` block: nothing runs until it ends.
        """
        with self._wakeup:
            self._num_pauses += 1
        try:
            yield
        finally:
            with self._wakeup:
                self._num_pauses -= 1
                self._wakeup.notify_all()

    def abort(self, request_ids: Iterable[str], error: BaseException | None = None) -> None:
        """End these requests at the next scheduling decision (thread-safe; unknown or finished ids are ignored).

        Their KV pages and interventions are released as for any finished request; a caller still
        waiting on one gets `error` (by default a RuntimeError saying it was aborted).
        """
        with self._wakeup:
            for request_id in request_ids:
                self._aborts[request_id] = error or RuntimeError(f"request {request_id} was aborted by its caller")
            self._wakeup.notify()

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop: requests in flight fail, the engine thread ends its step, then frees the runner.

        Returns False if the thread has not ended within `timeout` seconds (it still stops after
        its step; `nnrun.lifecycle` escalates at interpreter exit).
        """
        self.check_not_engine_thread("shutdown()")
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        if self._thread is None:
            self.runner.shutdown()
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- requests -------------------------------------------------------------------------
    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        index: int | None = None,
        request_id: str | None = None,
        extra_args: dict | None = None,
        preemptible: bool = True,
    ) -> Request:
        """Validate and tokenize on the caller's thread, so bad input never reaches the engine."""
        where = "prompt" if index is None else f"prompts[{index}]"
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt, where)
        return self.make_request_from_ids(
            token_ids,
            params,
            where=where,
            text=text,
            request_id=request_id,
            extra_args=extra_args,
            preemptible=preemptible,
        )

    def make_request_from_ids(
        self,
        token_ids: list[int],
        params: SamplingParams,
        *,
        where: str = "prompt",
        text: str | None = None,
        request_id: str | None = None,
        extra_args: dict | None = None,
        preemptible: bool = True,
    ) -> Request:
        """A request of token ids this process has checked already (`nnrun.prompts.tokenize_prompt`'s).

        Only the length is checked here; `make_request` is the door for anything a user handed over.
        """
        limit = min(self.runner.max_model_len, self.runner.max_total_tokens)
        if len(token_ids) >= limit:
            raise ValueError(
                f"{where} has {len(token_ids)} tokens, but the context holds {self.runner.max_model_len} "
                f"(max_model_len) and the KV pool {self.runner.max_total_tokens} tokens; at least one new token must fit"
            )
        req = Request(
            request_id=request_id or str(next(self._ids)),
            prompt_token_ids=token_ids,
            sampling_params=params,
            prompt=text,
            extra_args=dict(extra_args or {}),
            is_preemptible=preemptible,
        )
        if params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        if params.prompt_logprobs is not None and len(token_ids) == 1:
            req.prompt_logprobs = [None]
        return req

    def _tokenize(self, prompt: Prompt, where: str) -> tuple[str | None, list[int]]:
        return tokenize_prompt(prompt, where, self.tokenizer, self.vocab_size)

    @staticmethod
    def _params_per_prompt(
        params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
        return params

    # ---- the engine thread ----------------------------------------------------------------
    def _enqueue(self, requests: list[Request], stream: bool) -> list[RequestHandle]:
        self.check_not_engine_thread("model.trace(), model.generate() or an engine call")
        text_of = self.core.stop_checker.final_text
        handles = [RequestHandle(req, stream, text_of) for req in requests]
        with self._wakeup:
            if self._stopping:
                raise RuntimeError("the engine has been shut down")
            ids = [req.request_id for req in requests]
            taken = [i for i in ids if i in self._handles]
            if taken or len(set(ids)) != len(ids):
                raise ValueError(f"request_id {(taken or ids)[0]!r} is already in use")
            for req, handle in zip(requests, handles):
                req.arrival_order = next(self._arrivals)
                req.is_streamed = stream
                self._handles[req.request_id] = handle
            self._num_streams += len(requests) if stream else 0
            self._inbox.extend(requests)
            self._wakeup.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="nnrun-engine", daemon=True)
                self._thread.start()
        return handles

    def check_not_engine_thread(self, what: str) -> None:
        """Refuse work that would wait on the engine thread from the engine thread itself.

        A trace's block runs on the engine thread; a trace, `generate` or `shutdown` called from
        inside it would wait for a step that can only run once the block returns: a deadlock.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"{what} cannot be started from inside a trace's block: the block runs on the engine thread, "
                "which would wait for itself. Run it after the `with` block ends, or add the prompt to this "
                "trace with `tracer.invoke(...)`"
            )

    def _serve(self) -> None:
        """The engine thread: the loop, then the runner's teardown on this thread, which runs the blocks."""
        try:
            self._loop()
        finally:
            self.runner.shutdown()

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._stopping and (
                    self._num_pauses or not (self._inbox or self._aborts or self.core.has_unfinished)
                ):
                    self._wakeup.wait()
                if self._stopping:
                    self._publish((), self.core.abort_all(RuntimeError("the engine was shut down")))
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, {}
            for req in inbox:
                self.core.add_request(req)
            try:
                aborted = self.core.abort_requests(aborts)
                stepped, finished = self.core.step()
            except BaseException as error:  # an engine bug must not strand callers: fail what is in flight
                logger.exception("engine step failed; failing every request in flight")
                finished, stepped = self.core.abort_all(error), []
            else:
                finished = aborted + finished
            self._publish(stepped, finished)

    def _publish(self, stepped: Iterable[Request], finished: Iterable[Request] = ()) -> None:
        """Stream the stepped requests' outputs and wake the finished ones' callers.

        `finished` holds every request that ended; `stepped` matters only to streams, so with none
        open a step costs nothing here per running request.
        """
        stop_checker = self.core.stop_checker
        for req in itertools.chain(stepped if self._num_streams else (), finished):
            handle = self._handles.get(req.request_id)
            if handle is None:
                continue
            if handle._stream is not None:
                text = stop_checker.final_text(req) if req.is_finished else stop_checker.detokenize(req)
                handle._publish(RequestOutput.from_request(req, text))
            if req.is_finished:
                handle._finish()
                self._handles.pop(req.request_id, None)
                if handle._stream is not None:
                    with self._wakeup:
                        self._num_streams -= 1


def _eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    for source in (eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(t) for t in source)
    return ids
