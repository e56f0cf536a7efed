"""nnrun.LanguageModel: nnsight's model API, run on nnrun's continuous-batching engine.

The model owns an engine (`nnrun.LLM` with `NNsightGPUModelRunner`) and an nnsight tree over the
engine's HF module with the same paths as the runner's tree. Traces collect invokes on this tree
(`NNrunTracer`), and every prompt becomes one engine request; the engine thread runs the blocks.
Many threads may trace at once: a trace keeps its invokes on the tracer, never on the model.
A checkpoint given by name starts as a meta tree; its engine is built at the first trace
(interleaver/lazy_engine.py), as nnsight dispatches.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers import GenerationConfig

from nnsight import NNsight
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Interleaver
from nnsight.intervention.source import Source
from nnsight.tracing.tracer import WithBlockNotFoundError

from interleaver.attach import mirror_on_engine
from interleaver.attentions import ATTENTION_KWARGS, attention_args, check_spanning_invokes
from interleaver.edits import edit_invocations, edits_ask_for_grad, generate_with_edits
from interleaver.envoy_messages import InsideTrace, missing_attribute
from interleaver.generator import add_generator, user_streamer
from interleaver.jobs import Invocation, ParamsBook, TraceJob, pad_sequences
from interleaver.keywords import (
    GENERATE_KWARGS,
    INVOKE_KWARGS,
    STREAMER_KWARGS,
    TRACE_KWARGS,
    _check_kwargs,
    apply_tokenizer_settings,
    engine_kwargs,
    refuse_backends,
)
from interleaver.lazy_engine import EngineRecipe, open_slot
from interleaver.mediator import PackedInterleaver, ServedValues
from interleaver.nnsight_private import tracing_thread_state
from interleaver.run_job import run_trace_job
from interleaver.runner import NNsightGPUModelRunner
from interleaver.scan import ScanTracer
from interleaver.sources import client_source
from interleaver.streaming import StreamerFeed, generate_streamed
from interleaver.tp_front import TensorParallelNNsightRunner
from interleaver.tp_ship import refuse_on_ranks, ship_job, tag_envoys
from interleaver.tracer import NNrunTracer, PendingInvoke
from nnrun.engine import LLM
from nnrun.prompts import split_model_input, tokenize_prompt
from nnrun.sampling_params import SamplingParams

_trace_seq = itertools.count()
_request_seq = itertools.count()


class ClientInterleaver(Interleaver):
    """The client tree's interleaver: it never runs a forward; `engine_interleaver` does (None until the engine is built)."""

    def __init__(self, engine_interleaver: PackedInterleaver | None) -> None:
        super().__init__()
        self.engine_interleaver = engine_interleaver


class _ClientEnvoyMixin:
    """What a client envoy changes: ad-hoc calls and error messages for wrong paths."""

    def __call__(self, *args: Any, hook: bool = False, **kwargs: Any) -> Any:
        """An ad-hoc module call inside a block (a logit lens) must not be served as the real visit."""
        engine = self.interleaver.engine_interleaver
        if engine is None:  # no engine yet: no trace is running, so this is a plain call of the module
            return Envoy.__call__(self, *args, hook=hook, **kwargs)
        if engine.interleaving and not hook:
            engine.interleaving = False
            try:
                return self._module(*args, **kwargs)
            finally:
                engine.interleaving = True
        if engine.interleaving:  # a hooked call: other blocks reading it get their rows of the caller's values
            caller = engine.running_blocks.innermost()
            with engine.batcher.serving_call_by(getattr(caller, "batch_group", None)):
                return Envoy.__call__(self, *args, hook=hook, **kwargs)
        return Envoy.__call__(self, *args, hook=hook, **kwargs)

    @property
    def source(self) -> Source:
        """The module's forward as operations; `op.source` recurses on the engine (see interleaver/sources.py)."""
        return client_source(self)

    def _wrap_envoy(self, name: str, module: torch.nn.Module) -> Envoy:
        envoy = Envoy._wrap_envoy(self, name, module)
        mirror_on_engine(self, name, module)  # a module attached now must be served by the engine too
        return envoy

    def __getattr__(self, name: str) -> Any:
        try:
            return Envoy.__getattr__(self, name)
        except AttributeError:
            module = self.__dict__.get("_module")
            if name.startswith("_") or module is None:
                raise
            raise missing_attribute(self, module, name) from None

    # Outside a trace, these say to read them inside `with model.trace(...)`.
    output = InsideTrace(Envoy.output, "output")
    input = InsideTrace(Envoy.input, "input")
    inputs = InsideTrace(Envoy.inputs, "inputs")


class ClientEnvoy(_ClientEnvoyMixin, Envoy):
    """An envoy of the client tree."""


def set_nnsight_attributes(model: Any, model_or_path: Any, revision: str | None, given: dict) -> None:
    """The public attributes scripts read off nnsight's `LanguageModel`, with nnsight's values."""
    repo_id = model_or_path if isinstance(model_or_path, str) else getattr(model._module.config, "_name_or_path", None)
    attributes = {
        "repo_id": repo_id,
        "revision": revision,
        "args": (model_or_path,),
        "kwargs": given,
        "task": "text-generation",
        "peft": None,
        "processor": None,
        "image_processor": None,
        "feature_extractor": None,  # text models only
    }
    for name, value in attributes.items():
        if not isinstance(getattr(type(model), name, None), property):  # a subclass's own answer (VLLM's) stands
            object.__setattr__(model, name, value)


class LanguageModel(_ClientEnvoyMixin, ServedValues, NNsight):
    """nnsight's LanguageModel API on nnrun: `trace`, `generate`, invokes, edits, saves.

    `LanguageModel(model_or_path, tokenizer=None, device="cpu", dtype=None, **engine_kwargs)`
    builds an engine over the model (an HF `PreTrainedModel`, a checkpoint folder, a hub id or a
    bundled name) and mirrors its module tree: `model.model.layers[0].output` etc. As on nnsight,
    a checkpoint given by name is built on the meta device and its engine (which loads the weights)
    at the first trace or generate, unless `dispatch=True` (interleaver/lazy_engine.py). nnsight's own
    constructor keywords keep nnsight's meaning (`torch_dtype`, a one-device `device_map`,
    `tokenizer_kwargs`, `revision`, ...) or are refused by name (interleaver/keywords.py).
    `model.generator` serves a generation's ids and its streamer's calls (interleaver/generator.py).
    `LanguageModel(name, serve=url, api_key=None)` runs on an `nnrun serve` engine instead: this
    process holds only the module tree, on the meta device (`nnrun.serve.client.RemoteLanguageModel`).
    """

    def __new__(cls, *args: Any, serve: str | None = None, **kwargs: Any) -> Any:
        if serve is not None:
            from nnrun.serve.client import RemoteLanguageModel

            return RemoteLanguageModel(*args, serve=serve, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        model_or_path: Any,
        tokenizer: Any = None,
        device: str = "cpu",
        dtype: Any = None,
        rename: dict | None = None,
        **kwargs: Any,
    ) -> None:
        # nnsight's `kwargs`: the keywords the caller gave, less the two nnsight consumes itself.
        named = {
            "tokenizer": tokenizer,
            "dtype": dtype,
            "rename": rename,
            "device": None if device == "cpu" else device,
        }
        given = {key: value for key, value in named.items() if value is not None}
        given.update({key: value for key, value in kwargs.items() if key not in ("dispatch", "meta_buffers")})
        revision = kwargs.get("revision")
        dispatch = bool(kwargs.get("dispatch"))
        device, dtype, options, tokenizer_settings = engine_kwargs(model_or_path, device, dtype, kwargs)
        tensor_parallel = options.get("tensor_parallel_size", 1) != 1
        runner_cls = TensorParallelNNsightRunner if tensor_parallel else NNsightGPUModelRunner
        recipe = EngineRecipe(model_or_path, device, dtype, runner_cls, options)
        lazy = self.builds_engine_lazily and isinstance(model_or_path, str) and not dispatch and not tensor_parallel
        slot, module, tokenizer, engine_interleaver = open_slot(recipe, tokenizer, lazy)
        apply_tokenizer_settings(tokenizer, tokenizer_settings)
        # Aliases live on the client tree only: they point at the same envoys, whose paths (what the
        # engine's interleaver is asked for) stay HF's.
        super().__init__(module, interleaver=ClientInterleaver(engine_interleaver), envoys=ClientEnvoy, rename=rename)
        object.__setattr__(self, "_engine_slot", slot)
        object.__setattr__(self, "tokenizer", tokenizer)
        set_nnsight_attributes(self, model_or_path, revision, given)
        add_generator(self)
        if tensor_parallel:  # blocks travel to the ranks; this tree's envoys travel by path
            tag_envoys(self)

    builds_engine_lazily = True  # a checkpoint given by name: the engine is built at the first trace

    @property
    def engine(self) -> LLM:
        """The engine that runs this model's traces; built (the weights loaded) on first use."""
        return self._engine_slot.get(self)

    @property
    def dispatched(self) -> bool:
        """Whether the weights are loaded (nnsight's name): the engine has been built."""
        return self._engine_slot.engine is not None

    def dispatch(self) -> None:
        """Load the weights now: build the engine (a no-op once built), as nnsight's `dispatch()`."""
        self.engine

    # ---- tracing --------------------------------------------------------------------------
    def trace(self, *inputs: Any, trace: bool = True, **kwargs: Any) -> Any:
        """`with model.trace(prompt):` one forward of each prompt; `tracer.invoke(...)` for several.

        `model.trace(prompt, trace=False)` runs the forward at once and returns the model's output.
        """
        refuse_backends("trace", kwargs)
        _check_kwargs("trace", kwargs, TRACE_KWARGS + ATTENTION_KWARGS)  # generation settings: ignored, as on HF
        self.dispatch()
        if not trace:
            return self._forward_plain(inputs, kwargs)
        return NNrunTracer(self, "trace", *inputs, **kwargs)

    def _forward_plain(self, inputs: tuple, kwargs: dict) -> Any:
        """What `trace(..., trace=False)` returns: the output of the model's forward over the prompts."""
        with self.trace(*inputs, **kwargs) as tracer:
            output = tracer.result.save()
        return output

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """`with model.generate(prompt, max_new_tokens=...)`; called plainly, returns the token ids."""
        refuse_backends("generate", kwargs)
        _check_kwargs("generate", kwargs, GENERATE_KWARGS + STREAMER_KWARGS + ATTENTION_KWARGS)
        self.dispatch()
        tracer = NNrunTracer(self, "generate", *inputs, **kwargs)
        try:
            tracer.capture()
        except WithBlockNotFoundError:
            return self._generate_plain(inputs, kwargs)
        return tracer

    def scan(self, *inputs: Any, **kwargs: Any) -> ScanTracer:
        """`with model.scan(prompt):` shapes and dtypes on a meta copy of the model; the engine does not run."""
        return ScanTracer(self, *inputs, **kwargs)

    def shutdown(self) -> None:
        if self.dispatched:  # an engine never built has nothing to stop
            self.engine.shutdown()

    # ---- what the tracer asks of the model ------------------------------------------------
    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        """How many prompts a trace's own input holds (0: the body's invokes hold them)."""
        if not inputs:
            return 0
        return len(split_model_input(inputs[0])[0])

    def _build_job(self, kind: str, invokes: list[PendingInvoke], trace_kwargs: dict, needs_grad: bool) -> TraceJob:
        """One engine request per prompt; an empty invoke spans every request of the trace."""
        seq = next(_trace_seq)
        request_ids: list[list[str]] = []
        prompts: dict[str, list[int]] = {}
        params: dict[str, SamplingParams] = {}
        extra_args: dict[str, dict] = {}  # per request, what it asks of the engine (output_attentions)
        book = ParamsBook(lambda settings, prompt_len: self._sampling_params(kind, settings, prompt_len))
        for invoke in invokes:
            if invoke.prompts is None:
                invoke.prompts = self._invoke_prompts(kind, invoke.inputs, invoke.kwargs)
            settings = {**trace_kwargs, **invoke.kwargs}
            params_of = book.for_invoke(settings, has_own_settings=bool(invoke.kwargs))
            invoke_args = attention_args(settings)
            ids = []
            for prompt in invoke.prompts:
                request_id = f"nnsight-{seq}-{next(_request_seq)}"
                prompts[request_id] = prompt
                params[request_id] = params_of(len(prompt))
                extra_args[request_id] = invoke_args
                ids.append(request_id)
            request_ids.append(ids)
        every = [rid for ids in request_ids for rid in ids]
        if not every:
            raise ValueError("trace() needs at least one prompt: every invoke here is empty")
        check_spanning_invokes(request_ids, extra_args)
        invocations = [
            Invocation(invoke.mediator, ids or list(every), index)
            for index, (invoke, ids) in enumerate(zip(invokes, request_ids))
        ]
        # Stored edits (`model.edit()`) run first, over every request, as nnsight prepends them.
        invocations = edit_invocations(self._edits, every) + invocations
        needs_grad = needs_grad or edits_ask_for_grad(self._edits)
        job = TraceJob(
            kind,
            invocations,
            needs_grad=needs_grad,
            pad_token_id=self._pad_token_id(),
            seq=seq,
            streamer=user_streamer(kind, trace_kwargs),
            ids_device=self.engine.runner.device,
        )
        for request_id in every:  # the invokes' prompts were checked as they were tokenized
            job.requests[request_id] = self.engine.make_request_from_ids(
                prompts[request_id],
                params[request_id],
                request_id=request_id,
                extra_args={"nnsight": job, **extra_args[request_id]},
                preemptible=False,
            )
        return job

    def _run_job(self, job: TraceJob) -> None:
        """Submit every request of the trace at once, then wait for the engine to finalize it."""
        feed = None
        if job.streamer is not None:  # fed on this thread, never the engine's (see interleaver/streaming.py)
            feed = StreamerFeed(job.streamer, [r.prompt_token_ids for r in job.requests.values()], job.pad_token_id)
            feed.begin()
        self._ship_to_ranks(job)
        run_trace_job(self.engine, job, feed=feed)

    def _ship_to_ranks(self, job: TraceJob) -> None:
        """On tensor-parallel ranks, serialize the job here, on the caller's thread, where its saves are known."""
        if getattr(self.engine.runner, "ships_jobs", False):
            refuse_on_ranks(job)
            job.pushes_every_name = getattr(tracing_thread_state, "depth", 0) > 1  # inside a session
            job.shipped = ship_job(job, type(self))

    def _generate_plain(self, inputs: tuple, kwargs: dict) -> torch.Tensor:
        if self._edits:  # the edits run as blocks, so the prompts go through a trace's job
            return generate_with_edits(self, inputs, kwargs)
        prompts = self._prompts(inputs)
        params = [self._sampling_params("generate", kwargs, len(p)) for p in prompts]
        streamer = user_streamer("generate", kwargs)
        if streamer is None:
            outputs = self.engine.generate(prompts, params)
        else:
            outputs = generate_streamed(self.engine, prompts, params, streamer, self._pad_token_id())
        sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
        return pad_sequences(sequences, [len(p) for p in prompts], self._pad_token_id(), self.engine.runner.device)

    # ---- inputs and sampling --------------------------------------------------------------
    def _invoke_prompts(self, kind: str, inputs: tuple, kwargs: dict) -> list[list[int]]:
        """An invoke's prompts as token ids, after checking its keywords."""
        _check_kwargs("invoke", kwargs, INVOKE_KWARGS + ATTENTION_KWARGS)  # a trace's ignores them, as on HF
        return self._prompts(inputs)

    def _prompts(self, inputs: tuple) -> list[list[int]]:
        """An invoke's input as token-id lists: a string, token ids, a tensor, or a list of those."""
        if not inputs:
            return []
        if len(inputs) > 1:
            raise ValueError(f"an invoke takes one prompt or one list of prompts, got {len(inputs)} arguments")
        prompts, where = split_model_input(inputs[0])
        if len(prompts) == 1:
            return [self._tokenize(prompts[0], where)]
        return [self._tokenize(prompt, f"{where}[{i}]") for i, prompt in enumerate(prompts)]

    def _tokenize(self, prompt: Any, where: str) -> list[int]:
        return tokenize_prompt(prompt, where, self.tokenizer, self.engine.vocab_size)[1]

    def _pad_token_id(self) -> int:
        for source in (self.tokenizer, getattr(self._module, "generation_config", None), self._module.config):
            for name in ("pad_token_id", "eos_token_id"):
                value = getattr(source, name, None) if source is not None else None
                if isinstance(value, int):
                    return value
        return 0

    def _sampling_params(self, kind: str, kwargs: dict, prompt_len: int) -> SamplingParams:
        """HF `generate` keywords (and the model's generation config) as the engine's sampling."""
        if kind == "trace":
            return SamplingParams(max_tokens=1, temperature=0.0)
        config = getattr(self._module, "generation_config", None)
        defaults = GenerationConfig._get_default_generation_params()  # what HF fills in for unset settings

        def setting(name: str) -> Any:
            for source in (kwargs, vars(config) if config is not None else {}, defaults):
                if source.get(name) is not None:
                    return source[name]
            return None

        max_new = setting("max_new_tokens")
        if max_new is None:  # as HF: a max_length someone set counts the prompt, its own default does not
            explicit = kwargs.get("max_length") or getattr(config, "max_length", None)
            max_new = max(1, explicit - prompt_len) if explicit else defaults["max_length"]
        min_new = min(setting("min_new_tokens") or 0, max_new)
        if not setting("do_sample"):
            return SamplingParams(
                max_tokens=max_new,
                min_tokens=min_new,
                temperature=0.0,
                repetition_penalty=setting("repetition_penalty"),
            )
        return SamplingParams(
            max_tokens=max_new,
            min_tokens=min_new,
            temperature=setting("temperature"),
            top_k=setting("top_k") or 0,
            top_p=setting("top_p"),
            repetition_penalty=setting("repetition_penalty"),
            seed=kwargs.get("seed"),
        )


TransformersModel = LanguageModel  # nnsight 0.8.1's name for LanguageModel (which it deprecates; nnrun keeps both)
