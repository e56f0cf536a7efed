"""NNsightGPUModelRunner: the engine's runner, with nnsight mediators served around each phase.

The runner owns a second nnsight tree over the engine's HF module (`RunnerModel`), whose
interleaver serves the mediators the clients' traces hand over. One step:

1. `prepare_forward_batch_extend`: a traced prompt keeps the logits of all its positions (computed
   only if a block can still read them when the forward reaches the LM head: `HeadRows`);
2. `forward`: the request helper gives each mediator its spans, starts new ones (a generation's
   new blocks get `model.generator.streamer`'s prompt visit), and the packed forward runs inside
   the interleaver (with autograd on if a trace in the step asks for it);
3. `sample`: the interleaver serves `model.logits`, then the sampler runs, then it serves
   `model.samples` and the streamer's token visit; requests whose block raised or stopped are
   failed (the engine ends them);
4. `finish_requests` -> `finish_nnsight`: finished requests' mediators are finalized and their
   saves recorded; the client thread waiting on the trace picks them up.

A step with no nnsight request takes the base runner's path: no handoff is armed. So does a step
whose blocks have all finished or wait only for their trace's end (`NNsightRequestHelper.watch_step`):
the interleaver stands down, modules run their plain forward, and a decode step replays its graph.
A watched decode step runs in decoder-layer pieces (`nnrun.graph_pieces`): each layer in which no
block waits replays its own graph, a layer watched only at its input or output replays inside its
handoffs, and `WatchedLayers` keeps the visit counts as if it had run.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from nnsight import NNsight
from nnsight.intervention.source import Controller

from interleaver.batcher import InvalidWriteError, PackedBatcher
from interleaver.generator import serve_prompts, serve_step_tokens
from interleaver.head_rows import HeadRows, keep_next_rows_only, parked_where_logits_are_read
from interleaver.mediator import PackedInterleaver, ServedValues
from interleaver.requests import NNsightRequestHelper
from interleaver.save_spill import SavedValueLedger
from interleaver.watched_layers import WatchedLayers
from nnrun.attention import AttentionBackend
from nnrun.exact import family_of
from nnrun.forward_batch import ForwardBatch
from nnrun.model_runner import LogitsProcessorOutput, ModelRunner
from nnrun.request import Request
from nnrun.sampler import SamplerOutput


class RunnerModel(ServedValues, NNsight):
    """The runner's nnsight tree: same module paths as the client's, its own interleaver."""


class NNsightGPUModelRunner(ModelRunner):
    """A ModelRunner that serves nnsight interventions riding on its requests."""

    captures_graph_pieces = True  # a watched decode step replays the decoder layers no block waits inside

    def own_forward(self, module: torch.nn.Module) -> Callable | None:
        """Under nnsight's controller (the instance `forward` it installs, inert outside a trace), the module's
        own forward; a module with accelerate's hook (offloaded weights) keeps its controller, which runs it."""
        forward = module.__dict__.get("forward")
        if isinstance(forward, Controller):
            return None if "_hf_hook" in module.__dict__ else forward.state.original
        return super().own_forward(module)

    def unwatched(self) -> AbstractContextManager:
        """nnsight's controllers inert, as outside a trace: what runs inside serves no block."""
        return _NotInterleaving(self.interleaver)

    def load_model(self) -> None:
        super().load_model()
        self._counts_before_step: dict[str, int] = {}
        head = self.model.get_output_embeddings()
        head_path = _module_path(self.model, head)
        batcher = PackedBatcher(head_path)
        batcher.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.interleaver = PackedInterleaver(batcher, fragments=self.value_fragments())
        self.nnsight_model = RunnerModel(self.model, interleaver=self.interleaver, envoys=self.envoy_classes())
        self.nnsight_requests = NNsightRequestHelper(
            self.interleaver, SavedValueLedger.from_config(self.config.cache, self.device)
        )
        self.watched_layers = WatchedLayers(self.interleaver)
        self.head_rows = (
            None
            if head_path is None
            else HeadRows(self.model, head, head_path, self._may_read_logits, self._is_block_call)
        )

    def value_fragments(self) -> Any:
        """nnsight's `Fragments` for a model whose values are split over processes (a tensor-parallel rank's)."""
        return None

    def envoy_classes(self) -> Any:
        """nnsight's `envoys` option for the runner's tree (None: plain envoys)."""
        return None

    # ---- 1. layout ------------------------------------------------------------------------
    def keeps_all_logits(self, req: Request) -> bool:
        return self.nnsight_requests.wants_all_logits(req)  # a traced prompt's logits are HF's [1, T, V]

    def forward_groups(self, reqs: list[Request]) -> list[list[Request]]:
        """On the exact path, a request whose invoke spans several prompts fails: it needs them in one forward."""
        groups = super().forward_groups(reqs)
        if len(groups) == 1:
            return groups
        spanning = [req for req in reqs if _spans_several_requests(req)]
        for req in spanning:
            req.fail(
                ValueError(
                    f"{family_of(self.model)} runs on nnrun's exact path (one HF forward per prompt), where an invoke "
                    "over several prompts (an empty invoke, or a list of prompts in one invoke) cannot see them in one "
                    "forward; give each prompt its own tracer.invoke(...)"
                )
            )
        return [group for group in groups if group[0] not in spanning]

    def allows_multi_step(self, reqs: list[Request]) -> bool:
        """A traced request's blocks see every step, and only its own: its steps run one per decision, until
        no block of its trace can touch a step again (then they run as untraced steps, windows included)."""
        return self.nnsight_requests.steps_unwatched(reqs) and super().allows_multi_step(reqs)

    # ---- 2. forward -----------------------------------------------------------------------
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        helper = self.nnsight_requests
        helper.process_new_reqs(forward_batch.reqs)
        invocations, logit_spans = [], []
        if helper.has_requests and not helper.steps_unwatched(forward_batch.reqs):  # else: as an untraced step
            logit_spans = _logit_spans(forward_batch)
            invocations = helper.process_batch_groups(forward_batch, logit_spans)
        if not invocations:
            helper.step_invocations, helper.is_watched = [], False
            return super().forward(forward_batch)
        self.interleaver.batcher.set_step(
            forward_batch.num_tokens,
            int(forward_batch.logits_indices.numel()),
            forward_batch.batch_size,
            forward_batch.extend_seq_lens,
            [length for _, length in logit_spans],
        )
        self.interleaver.mediators = []
        self._counts_before_step = dict(self.interleaver.counts)
        with self.interleaver:
            helper.start(invocations)
            if serve_prompts(invocations):  # HF's streamer has the prompt ids before the first forward
                helper.keep_running()
            helper.watch_step()  # no block touches the step: it runs as an untraced one (graphs included)
            logits = self.run_model(forward_batch)  # [R, V]
        self._keep_trace_outputs(forward_batch, logits)
        return self.process_logits(logits, forward_batch)

    def run_model(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The step's forward -> logits `[R, V]`; a traced prompt's LM head runs on its sampled rows only
        (`[B, V]`, the layout cut to match) when no block can read its other rows (`HeadRows`)."""
        head_rows = self.head_rows
        if head_rows is None or not self.path.packs_requests or self.returns_every_position:
            return super().run_model(forward_batch)
        with head_rows.step(forward_batch, self.device):
            logits = super().run_model(forward_batch)
        if head_rows.is_trimmed:
            keep_next_rows_only(forward_batch)
        return logits

    def _may_read_logits(self, reads_logits: Callable[[str], bool]) -> bool:
        """At the LM head: whether a block of the step may read the step's logits (see `HeadRows`)."""
        if self.interleaver.batcher.pending_skips:
            return True
        return parked_where_logits_are_read(
            (inv.mediator for inv in self.nnsight_requests.step_invocations), reads_logits
        )

    def _is_block_call(self) -> bool:
        return self.interleaver.running_blocks.innermost() is not None

    # ---- blocks on the engine thread (what a server's watchdogs read and end) -------------
    def num_live_blocks(self) -> int:
        """Blocks of traces in flight (started or not), for monitoring."""
        return len(self.nnsight_requests.live)

    def running_block(self) -> Any | None:
        """The mediator whose block the engine thread is running right now, or None between blocks."""
        return self.interleaver.running_blocks.innermost()

    def interrupt_blocks(self, mediators: list[Any]) -> bool:
        """Raise `BlockCancelled` in the running block if it is one of `mediators`; True if it was."""
        return self.interleaver.running_blocks.interrupt(mediators)

    def interrupt_running_blocks(self) -> bool:
        """Raise `BlockCancelled` in whatever block is running now (a server shutting down); True if one was."""
        return self.interrupt_blocks(self.interleaver.running_blocks.snapshot())

    def requests_to_blame(self, reqs: list[Request]) -> list[Request]:
        """After a failed step: the requests whose blocks edited one of its values, which the engine ends.

        The step then runs once more without them. Blocks that only read are not to blame: their
        workers are parked further on, and the visit counts go back to where the step began, so
        the re-run serves each of them the locations it still waits for, once.
        """
        helper = self.nnsight_requests
        if not helper.step_invocations:
            return []
        editors = helper.editors_in_step()
        for invocation in editors:
            invocation.mediator.batch_group = None
        helper.step_invocations = []
        self.interleaver.mediators = []
        self.interleaver.counts = dict(self._counts_before_step)
        blamed = {request_id for inv in editors for request_id in inv.request_ids}
        return [req for req in reqs if req.request_id in blamed]

    def grad_context(self, forward_batch: ForwardBatch) -> AbstractContextManager:
        """Autograd for a step whose trace asked for gradients (the KV pool stores detached values)."""
        if self.nnsight_requests.needs_grad(forward_batch):
            return torch.enable_grad()
        return super().grad_context(forward_batch)

    def attention_backend_for(self, forward_batch: ForwardBatch) -> AttentionBackend:
        """Gradients need attention written in torch ops; fused kernels have no backward."""
        if self.nnsight_requests.needs_grad(forward_batch):
            return self.torch_attention_backend()
        return super().attention_backend_for(forward_batch)

    def can_use_cuda_graph(self, forward_batch: ForwardBatch) -> bool:
        """A replayed graph would skip every intervention point: steps a block may touch run eagerly."""
        return not self.nnsight_requests.is_watched and super().can_use_cuda_graph(forward_batch)

    def piece_gate(self, forward_batch: ForwardBatch) -> WatchedLayers | None:
        """A watched decode step runs in decoder-layer pieces unless a block drills into `.source` or skips."""
        interleaver = self.interleaver
        if not self.nnsight_requests.is_watched or interleaver.sourced or interleaver.batcher.pending_skips:
            return None
        return self.watched_layers

    def _keep_trace_outputs(self, forward_batch: ForwardBatch, logits: torch.Tensor) -> None:
        """A traced prompt's logits, for its `tracer.result` (built only if a block waits for it)."""
        if all(invocation.job.kind != "trace" for invocation in self.nnsight_requests.step_invocations):
            return  # a generation's steps: nothing to keep (every request of a trace has an invocation here)
        output_type = getattr(self, "output_type", CausalLMOutputWithPast)
        for req, (start, length) in zip(forward_batch.reqs, _logit_spans(forward_batch)):
            job = _job_of(req)
            if job is not None and job.kind == "trace":
                job.output_type = output_type
                job.results[req.request_id] = logits[start : start + length][None]  # [1, T, V]

    # ---- 3. logits and samples ------------------------------------------------------------
    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> SamplerOutput:
        helper = self.nnsight_requests
        if not helper.step_invocations:
            return super().sample(logits_output, forward_batch)
        if not helper.is_watched:  # as an untraced step; only blocks that raised at their start end their requests
            sampler_output = super().sample(logits_output, forward_batch)
            helper.end_step(forward_batch)
            return sampler_output
        model = self.nnsight_model
        interleaver = self.interleaver
        if helper.keep_running():  # (each `keep_running` reindexes the workers the next visit serves)
            with interleaver.resumed():
                logits_output.next_token_logits = type(model).logits.provide(model, logits_output.next_token_logits)
        sampler_output = super().sample(logits_output, forward_batch)
        if helper.keep_running():
            sampled = sampler_output.token_ids
            version = sampled._version
            with interleaver.resumed():
                sampler_output.token_ids = type(model).samples.provide(model, sampled)
            # An assignment was checked where it was made; only an in-place edit (which bumps the
            # version counter) can have put a token outside the vocabulary.
            if sampler_output.token_ids is not sampled or sampled._version != version:
                self._fail_invalid_samples(forward_batch.reqs, sampler_output.token_ids)
            with interleaver.resumed():  # then HF's streamer has the step's tokens
                serve_step_tokens(helper.step_invocations, forward_batch, sampler_output.token_ids)
        helper.end_step(forward_batch)
        return sampler_output

    def _fail_invalid_samples(self, reqs: list[Request], token_ids: torch.Tensor) -> None:
        """A block that edited `model.samples` in place to a token outside the vocabulary ends its own request.

        (An assignment is checked where it is made; an in-place edit is only seen here.) The row gets
        a valid placeholder so the step's bookkeeping goes on; a failed request never appends it.
        """
        vocab_size = self.interleaver.batcher.vocab_size
        is_bad = (token_ids < 0) | (token_ids >= vocab_size)  # [B]
        if not bool(is_bad.any()):
            return
        for row in is_bad.nonzero().flatten().tolist():
            reqs[row].fail(
                InvalidWriteError(
                    f"model.samples: token id {int(token_ids[row])} is outside the vocabulary [0, {vocab_size})"
                )
            )
        token_ids.masked_fill_(is_bad, 0)

    # ---- 4. finishing ---------------------------------------------------------------------
    def finish_requests(self, reqs: list[Request]) -> None:
        super().finish_requests(reqs)
        self.finish_nnsight(reqs)

    def finish_nnsight(self, finished_requests: list[Request]) -> dict[str, dict[str, Any]]:
        """Finalize the mediators whose requests all finished; return each finished request's saves."""
        helper = self.nnsight_requests
        invocations = helper.process_finished_reqs([r for r in finished_requests if _job_of(r) is not None])
        helper.finish(invocations)
        saves: dict[str, dict[str, Any]] = {}
        for invocation in invocations:
            for request_id in invocation.request_ids:
                saves.setdefault(request_id, {}).update(invocation.saves)
        return saves

    def shutdown(self) -> None:
        """Finish the blocks still live, then free the pools.

        The engine calls this on its own thread as that thread ends: a parked block's greenlet can
        only be unwound on the thread that runs it. The engine has failed every request by then, so
        normally none is live; one that is (the engine thread ended abnormally) fails its trace.
        """
        helper = self.nnsight_requests
        live = list(helper.live)
        for invocation in live:
            invocation.error = invocation.error or RuntimeError("the engine stopped before this block finished")
        helper.request_to_invocations.clear()
        helper.finish(live)
        super().shutdown()


def _job_of(req: Request) -> Any:
    return req.extra_args.get("nnsight")


def _spans_several_requests(req: Request) -> bool:
    job = _job_of(req)
    return job is not None and any(len(set(inv.request_ids)) > 1 for inv in job.invocations_of(req.request_id))


def _logit_spans(forward_batch: ForwardBatch) -> list[tuple[int, int]]:
    """Each request's rows in the step's logits: the runner lays them out contiguously in batch order."""
    spans, start = [], 0
    for last in forward_batch.next_token_logits_rows:
        spans.append((start, last - start + 1))
        start = last + 1
    return spans


def _module_path(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    """The nnsight path (`model.<HF name>`) of a submodule, or None."""
    if module is None:
        return None
    for name, candidate in model.named_modules():
        if candidate is module:
            return f"model.{name}" if name else "model"
    return None


class _NotInterleaving:
    """The interleaver set aside for a while (a lazy graph capture inside a step), then as it was."""

    __slots__ = ("interleaver", "was")

    def __init__(self, interleaver: PackedInterleaver) -> None:
        self.interleaver = interleaver

    def __enter__(self) -> None:
        self.was = self.interleaver.interleaving
        self.interleaver.interleaving = False

    def __exit__(self, *exc: object) -> None:
        self.interleaver.interleaving = self.was
