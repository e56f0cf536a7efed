"""nnrun.LanguageModel: nnsight's model API, run on nnrun's continuous-batching engine.

The model owns an engine (`nnrun.LLM` with `NNsightGPUModelRunner`) and an nnsight tree over the
engine's HF module with the same paths as the runner's tree. Traces collect invokes on this tree
(`NNrunTracer`), and every prompt becomes one engine request; the engine thread runs the blocks.
Many threads may trace at once: a trace keeps its invokes on the tracer, never on the model.
"""

from __future__ import annotations

import difflib
import itertools
from typing import Any, Sequence

import torch
from transformers import GenerationConfig

from nnsight import NNsight
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Interleaver
from nnsight.tracing.tracer import WithBlockNotFoundError

from interleaver.mediator import PackedInterleaver, ServedValues
from interleaver.requests import Invocation, TraceJob, pad_sequences
from interleaver.runner import NNsightGPUModelRunner
from interleaver.tracer import NNrunTracer, PendingInvoke
from nnrun.engine import LLM
from nnrun.prompts import split_model_input, tokenize_prompt
from nnrun.sampling_params import SamplingParams

GENERATE_KWARGS = (
    "max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "seed",
)
_trace_seq = itertools.count()
_request_seq = itertools.count()


class ClientInterleaver(Interleaver):
    """The client tree's interleaver: it never runs a forward; `engine_interleaver` does."""

    def __init__(self, engine_interleaver: PackedInterleaver) -> None:
        super().__init__()
        self.engine_interleaver = engine_interleaver


class _ClientEnvoyMixin:
    """What a client envoy changes: ad-hoc calls and error messages for wrong paths."""

    def __call__(self, *args: Any, hook: bool = False, **kwargs: Any) -> Any:
        """An ad-hoc module call inside a block (a logit lens) must not be served as the real visit."""
        engine = self.interleaver.engine_interleaver
        if engine.interleaving and not hook:
            engine.interleaving = False
            try:
                return self._module(*args, **kwargs)
            finally:
                engine.interleaving = True
        return Envoy.__call__(self, *args, hook=hook, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return Envoy.__getattr__(self, name)
        except AttributeError:
            module = self.__dict__.get("_module")
            if name.startswith("_") or module is None:
                raise
            children = list(module._modules)
            close = difflib.get_close_matches(name, children + [n for n in dir(module) if not n.startswith("_")], n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise AttributeError(
                f"{self.path}.{name}: {type(module).__name__} at {self.path!r} has no submodule or attribute "
                f"{name!r}{hint} (its submodules: {', '.join(children) or 'none'})"
            ) from None


class ClientEnvoy(_ClientEnvoyMixin, Envoy):
    """An envoy of the client tree."""


class LanguageModel(_ClientEnvoyMixin, ServedValues, NNsight):
    """nnsight's LanguageModel API on nnrun: `trace`, `generate`, invokes, edits, saves.

    `LanguageModel(model_or_path, tokenizer=None, device="cpu", dtype=None, **engine_kwargs)`
    builds an engine over the model (an HF `PreTrainedModel`, a checkpoint folder, a hub id or a
    bundled name) and mirrors its module tree: `model.model.layers[0].output` etc.
    """

    def __init__(self, model_or_path: Any, tokenizer: Any = None, device: str = "cpu", dtype: Any = None,
                 **engine_kwargs: Any) -> None:
        engine = LLM(model_or_path, tokenizer=tokenizer, device=device, dtype=dtype,
                     runner_cls=NNsightGPUModelRunner, **engine_kwargs)
        super().__init__(engine.model, interleaver=ClientInterleaver(engine.runner.interleaver), envoys=ClientEnvoy)
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "tokenizer", engine.tokenizer)

    # ---- tracing --------------------------------------------------------------------------
    def trace(self, *inputs: Any, **kwargs: Any) -> NNrunTracer:
        """`with model.trace(prompt):` one forward of each prompt; `tracer.invoke(...)` for several."""
        _check_kwargs("trace", kwargs, ())
        return NNrunTracer(self, "trace", *inputs, **kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """`with model.generate(prompt, max_new_tokens=...)`; called plainly, returns the token ids."""
        _check_kwargs("generate", kwargs, GENERATE_KWARGS)
        tracer = NNrunTracer(self, "generate", *inputs, **kwargs)
        try:
            tracer.capture()
        except WithBlockNotFoundError:
            return self._generate_plain(inputs, kwargs)
        return tracer

    def shutdown(self) -> None:
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
        for invoke in invokes:
            if invoke.prompts is None:
                invoke.prompts = self._invoke_prompts(kind, invoke.inputs, invoke.kwargs)
            ids = []
            for prompt in invoke.prompts:
                request_id = f"nnsight-{seq}-{next(_request_seq)}"
                prompts[request_id] = prompt
                params[request_id] = self._sampling_params(kind, {**trace_kwargs, **invoke.kwargs}, len(prompt))
                ids.append(request_id)
            request_ids.append(ids)
        every = [rid for ids in request_ids for rid in ids]
        if not every:
            raise ValueError("trace() needs at least one prompt: every invoke here is empty")
        invocations = [Invocation(invoke.mediator, ids or list(every), index)
                       for index, (invoke, ids) in enumerate(zip(invokes, request_ids))]
        job = TraceJob(kind, invocations, needs_grad=needs_grad, pad_token_id=self._pad_token_id(), seq=seq)
        for request_id in every:
            job.requests[request_id] = self.engine.make_request(
                prompts[request_id], params[request_id], request_id=request_id, extra_args={"nnsight": job},
                preemptible=False,
            )
        return job

    def _run_job(self, job: TraceJob) -> None:
        """Submit every request of the trace at once, then wait for the engine to finalize it."""
        engine = self.engine
        # A gang: one step admits every request of the trace (invokes that share values, and
        # barriers, need their requests in the same forward).
        engine.submit_requests(list(job.requests.values()), gang=True)
        try:
            while not job.done.wait(1.0):
                if all(request.is_finished for request in job.requests.values()):
                    with engine.runner.step_lock:  # a step that finished them has also finalized them
                        if not job.done.is_set():
                            raise RuntimeError("the engine finished this trace's requests without finalizing "
                                               "its blocks")
        except BaseException:  # Ctrl-C while waiting: end the trace's requests, free their KV and blocks
            engine.abort(list(job.requests))
            # A block still running (a loop) would hold the engine thread, so the abort would never be seen.
            engine.runner.interleaver.running_blocks.interrupt([inv.mediator for inv in job.invocations])
            raise

    def _generate_plain(self, inputs: tuple, kwargs: dict) -> torch.Tensor:
        prompts = self._prompts(inputs)
        params = [self._sampling_params("generate", kwargs, len(p)) for p in prompts]
        outputs = self.engine.generate(prompts, params)
        sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
        return pad_sequences(sequences, [len(p) for p in prompts], self._pad_token_id())

    # ---- inputs and sampling --------------------------------------------------------------
    def _invoke_prompts(self, kind: str, inputs: tuple, kwargs: dict) -> list[list[int]]:
        """An invoke's prompts as token ids, after checking its keywords."""
        _check_kwargs("invoke", kwargs, GENERATE_KWARGS if kind == "generate" else ())
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
            return SamplingParams(max_tokens=max_new, min_tokens=min_new, temperature=0.0,
                                  repetition_penalty=setting("repetition_penalty"))
        return SamplingParams(
            max_tokens=max_new, min_tokens=min_new, temperature=setting("temperature"), top_k=setting("top_k") or 0,
            top_p=setting("top_p"), repetition_penalty=setting("repetition_penalty"), seed=kwargs.get("seed"),
        )


def _check_kwargs(where: str, kwargs: dict, allowed: Sequence[str]) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise TypeError(f"{where}() got unsupported keyword(s) {', '.join(unknown)}; nnrun accepts: {accepted}")
