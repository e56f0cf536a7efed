"""nnrun.VLLM: code written for nnsight's `VLLM` class, run unchanged on nnrun's engine.

nnsight's `VLLM` differs from its `LanguageModel` in spelling, not in protocol: every trace is a
generation whose keywords are vLLM `SamplingParams` (16 tokens at temperature 1 unless told),
`generate` is `trace`, `tracer.result` is a finished `RequestOutput`, a plain `generate(...)`
returns `RequestOutput`s, and `model.samples` is vLLM's `[1, 1]`. This subclass of nnrun's
`LanguageModel` changes exactly those; the module tree, the activations and everything the
engine does stay nnrun's (HF's).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable

import torch

from nnsight.intervention.eproperty import eproperty
from nnsight.tracing.tracer import WithBlockNotFoundError

from interleaver.attentions import ATTENTION_KWARGS
from interleaver.jobs import TraceJob
from interleaver.mediator import PackedMediator
from interleaver.model import LanguageModel
from interleaver.tracer import NNrunTracer, PendingInvoke
from interleaver.vllm_params import (
    check_sampling_kwargs,
    vllm_engine_kwargs,
    vllm_sampling_kwargs,
    vllm_sampling_params,
)
from nnrun.outputs import RequestOutput
from nnrun.prompts import split_model_input
from nnrun.request import Request
from nnrun.sampling_params import SamplingParams

# The body of a plain `generate(...)` that must run as a job (stored edits): it only carries the prompts.
_EMPTY_BLOCK = compile("pass", "<nnrun.VLLM: generate without a block>", "exec")


class VLLMTracer(NNrunTracer):
    """A VLLM trace: invoke keywords are sampling settings, spelled as nnsight's VLLM accepts them."""

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        return super().invoke(*args, **vllm_sampling_kwargs(kwargs))


class VLLM(LanguageModel):
    """nnsight's `VLLM` API on nnrun: `VLLM("gpt2")`, `model.trace(prompt, temperature=0.0, max_tokens=3)`.

    `VLLM(model_or_path, **kwargs)` takes what `nnrun.LanguageModel` takes (a bundled name, an HF
    model, a folder or a hub id, nnrun's engine options) and vLLM's engine keywords where they map:
    dtype, max_model_len, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, block_size,
    enforce_eager, tokenizer, device (default: CUDA when present), trust_remote_code, revision,
    load_format, seed (seeds torch's global RNG, which nnrun's engine draws unseeded samples from, as
    vLLM seeds its worker's). `dispatch=` is accepted and changes nothing: the engine is built at once.
    Tensor/pipeline/data parallelism, `distributed_executor_backend="ray"`, `mode="async"`,
    quantization and LoRA raise `NotImplementedError` naming the keyword.

    Every trace is a vLLM request per prompt: `trace`/`invoke` keywords are `vllm.SamplingParams`
    fields with vLLM's meaning and defaults (`max_tokens=16`, `temperature=1.0`; below 1e-5 is
    greedy); invoke keywords override the trace's. `max_new_tokens` is read as `max_tokens`.
    Read each step through `model.logits` (`[1, vocab]`) and `model.samples` (`[1, 1]`, as vLLM's
    sampler gives) under `tracer.iter[...]`/`tracer.all()`, and the finished request through
    `tracer.result` (a `RequestOutput`). `generate` used as a `with` block is `trace`; called plainly
    it returns the `RequestOutput`s. Prompts: a string, token ids, a tokenizer's
    `{"input_ids", "attention_mask"}`, or vLLM's `{"prompt": ...}`/`{"prompt_token_ids": ...}`.

    Deliberate differences from nnsight on vLLM: the module tree is HF's (`q_proj`/`k_proj`/`v_proj`
    and `gate_proj`/`up_proj`, decoder layers returning HF's hidden states, not vLLM's merged
    `qkv_proj`/`gate_up_proj` and `(hidden, residual)` pairs), and activations are HF-shaped
    `[1, T, H]` per prompt (a decode step `[1, 1, H]`), not a flat `[tokens, H]`: code that indexes
    tokens on dim 0 (`output[-1, :] += v`) must index dim 1 (`output[:, -1, :] += v`), or it
    silently edits every token. `lm_head.output` holds only the positions a step samples from
    (`[1, 1, V]`), as HF's `generate` and vLLM compute them. nnrun also allows what nnsight's VLLM
    refuses: several prompts per invoke (then `model.logits` is `[k, V]`, `model.samples` `[k, 1]`,
    `tracer.result` a list), empty invokes spanning every prompt, `tracer.barrier`, gradients,
    `.skip()`, `scan` and `output_attentions=True`. `model.edit()` is nnsight's LanguageModel one
    (replayed on this model's traces and plain `generate`s), not vLLM's `(tracer, edit)` handle that
    also runs on other clients' requests; `serve=`/`remote=` and `output.saves` are not available.
    """

    def __init__(self, model_or_path: Any, tokenizer: Any = None, device: str | None = None, **kwargs: Any) -> None:
        engine_kwargs, seed = vllm_engine_kwargs(kwargs)
        if seed is not None:
            torch.manual_seed(seed)
        if device is None:  # vLLM runs on the GPU; nnrun falls back to the CPU where there is none
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(model_or_path, tokenizer=tokenizer, device=device, **engine_kwargs)

    @property
    def vllm_entrypoint(self) -> Any:
        """The engine (nnsight's VLLM names its `vllm.LLM` so); `nnrun.LLM` has vLLM's `generate`."""
        return self.engine

    builds_engine_lazily = False  # nnsight's VLLM builds its engine in the constructor

    @property
    def dispatched(self) -> bool:
        return True  # the engine is built in the constructor

    def dispatch(self) -> None:
        """Nothing to do: the engine is built in the constructor."""

    # ---- tracing --------------------------------------------------------------------------
    def trace(self, *inputs: Any, **kwargs: Any) -> VLLMTracer:
        """`with model.trace(prompt, temperature=0.0, max_tokens=3):` one engine request per prompt."""
        return self._tracer("trace", inputs, kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """As a `with` block, `trace`; called plainly, the engine's `RequestOutput`s for the prompts."""
        tracer = self._tracer("generate", inputs, kwargs)
        try:
            tracer.capture()  # looks two frames up: this method's caller, as for `with model.generate(...)`
        except WithBlockNotFoundError:
            return self._generate_outputs(inputs, kwargs)
        return tracer

    def _generate_outputs(self, inputs: tuple, kwargs: dict) -> list[RequestOutput]:
        """One request per prompt (a list is a batch, as in vLLM's `LLM.generate`), no block."""
        if not inputs:
            raise ValueError("generate() needs a prompt or a list of prompts")
        prompts, _ = split_model_input(_from_vllm_prompts(inputs[0] if len(inputs) == 1 else list(inputs)))
        params = vllm_sampling_params(kwargs, "generate")
        if not self._edits:
            return self.engine.generate(prompts, params)
        # Stored edits (`model.edit()`) run as blocks, so the prompts go through a trace's job.
        invoke = PendingInvoke(PackedMediator(_EMPTY_BLOCK, {}, {}), (prompts,))
        job = self._build_job("generate", [invoke], kwargs, False)
        self._run_job(job)
        if job.error is not None:
            raise job.error
        own = next(inv for inv in job.invocations if inv.mediator is invoke.mediator)  # the edits' come first
        requests = [job.requests[rid] for rid in own.request_ids]
        return _request_outputs(requests, self.engine.core.stop_checker.final_text)

    def _tracer(self, where: str, inputs: tuple, kwargs: dict) -> VLLMTracer:
        kwargs = vllm_sampling_kwargs(kwargs)
        check_sampling_kwargs(where, _sampling_only(kwargs))
        return VLLMTracer(self, "generate", *inputs, **kwargs)

    # ---- what the tracer asks of the model ------------------------------------------------
    def _build_job(self, kind: str, invokes: list, *args: Any, **kwargs: Any) -> TraceJob:
        job = super()._build_job(kind, invokes, *args, **kwargs)
        job.make_result = functools.partial(_traced_result, text_of=self.engine.core.stop_checker.final_text)
        invocations = {id(invocation.mediator): invocation for invocation in job.invocations}
        for invoke in invokes:  # keep the prompt text, as vLLM's outputs do
            invocation = invocations.get(id(invoke.mediator))
            if invocation is not None and len(invoke.inputs) == 1:
                texts, _ = split_model_input(_from_vllm_prompts(invoke.inputs[0]))
                for text, request_id in zip(texts, invocation.request_ids):
                    if isinstance(text, str):
                        job.requests[request_id].prompt = text
        return job

    def _invoke_prompts(self, kind: str, inputs: tuple, kwargs: dict) -> list[list[int]]:
        check_sampling_kwargs("invoke", _sampling_only(vllm_sampling_kwargs(kwargs)))
        return self._prompts(inputs)

    def _prompts(self, inputs: tuple) -> list[list[int]]:
        if len(inputs) == 1:
            inputs = (_from_vllm_prompts(inputs[0]),)
        return super()._prompts(inputs)

    def _sampling_params(self, kind: str, kwargs: dict, prompt_len: int) -> SamplingParams:
        """The trace's keywords overridden by the invoke's, as one vLLM `SamplingParams`."""
        return vllm_sampling_params(_sampling_only(kwargs))

    # ---- per-step values ------------------------------------------------------------------
    @eproperty(description="token ids sampled this step")
    def samples(self, value: Any) -> Any:
        """`[1, 1]` (a list invoke: `[k, 1]`) token ids sampled this step, as vLLM's sampler gives them.

        A view of the engine's `[k]` row values, so in-place edits force tokens too.
        """
        return value.unsqueeze(-1)

    @samples.postprocess
    def samples(self, value: Any) -> Any:
        """An assigned `[k, 1]` goes back as the engine's `[k]` (a `[k]` is taken as it is)."""
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[-1] == 1:
            return value[:, 0]
        return value


def _sampling_only(kwargs: dict) -> dict:
    """The keywords left for `SamplingParams`: nnrun's own trace keywords (output_attentions) set up the request."""
    return {name: value for name, value in kwargs.items() if name not in ATTENTION_KWARGS}


def _from_vllm_prompts(data: Any) -> Any:
    """vLLM's prompt dicts (`TokensPrompt`, `TextPrompt`), one or a list, as nnrun prompts."""
    if isinstance(data, list) and data and all(isinstance(item, Mapping) for item in data):
        return [_from_vllm_prompt(item) for item in data]
    return _from_vllm_prompt(data)


def _from_vllm_prompt(data: Any) -> Any:
    if not isinstance(data, Mapping) or "input_ids" in data:
        return data  # a tokenizer's output stays as it is: nnrun reads it itself
    extra = sorted(set(data) - {"prompt", "prompt_token_ids"})
    if extra:
        raise NotImplementedError(
            f"a prompt dict with {', '.join(extra)}: nnrun.VLLM takes text prompts only "
            "({'prompt': ...} or {'prompt_token_ids': ...})"
        )
    if "prompt_token_ids" in data:
        return list(data["prompt_token_ids"])
    if "prompt" in data:
        return data["prompt"]
    raise ValueError("a prompt dict needs 'prompt', 'prompt_token_ids' or 'input_ids', got no keys")


def _traced_result(requests: list[Request], text_of: Callable[[Request], str]) -> RequestOutput | list[RequestOutput]:
    """`tracer.result` on VLLM: the invoke's finished `RequestOutput` (several prompts: a list)."""
    outputs = _request_outputs(requests, text_of)
    return outputs[0] if len(outputs) == 1 else outputs


def _request_outputs(requests: list[Request], text_of: Callable[[Request], str]) -> list[RequestOutput]:
    """Finished requests as vLLM's outputs; `text_of` gives a finished request's text (the engine's stop checker)."""
    outputs = []
    for req in requests:
        output = RequestOutput.from_request(req, text_of(req))
        # The trace's own job rides in extra_args; a saved result must not keep it (and its blocks) alive.
        extra = {name: value for name, value in req.extra_args.items() if name != "nnsight"}
        outputs.append(dataclasses.replace(output, extra_args=extra))
    return outputs
