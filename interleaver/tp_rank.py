"""NNsightShardRunner: the nnsight bridge's runner on one tensor-parallel rank.

Every rank holds a shard and runs every block of every trace, as nnsight runs a sharded HF model
under torchrun: nnsight's `TPFragments` gathers a column-sharded value (a `q_proj` output) before a
block sees it and re-shards what the block leaves, so blocks see HF's whole tensors and their writes
land alike on every rank. The front end (interleaver/tp_front.py) schedules; each step it sends the
traces new to the ranks, the step's layout and each row's request, and rank 0 answers with the
sampled tokens (rank 0 samples and broadcasts, so `model.samples` is the same everywhere), the
requests whose blocks failed, and, when requests finish, what their blocks saved.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nnsight.modeling.tp.envoys import tp_envoys

import nnrun.tp.wire as wire
from interleaver.generator import add_generator
from interleaver.runner import NNsightGPUModelRunner
from interleaver.tp_fragments import RankFragments
from interleaver.tp_ship import RankEnvoys, portable_error, receive_jobs, ship_results
from nnrun.attention import ATTN_IMPLEMENTATION
from nnrun.request import Request, RequestStatus
from nnrun.sampler import SamplerOutput
from nnrun.tp.worker import ShardRunner


@dataclass
class StepRow:
    """One row of a step as the front end sees it: what a rank needs to sample it and to serve its blocks."""

    request_id: str
    num_computed_tokens: int
    output_token_ids: list[int]
    generator_state: torch.Tensor | None  # a seeded request's RNG, carried to rank 0 and back
    # A request no trace owns (a plain generation beside the traces) comes whole every step:
    prompt_token_ids: list[int] | None = None
    sampling_params: Any = None
    extra_args: dict | None = None


@dataclass
class StepAnswer:
    """Rank 0's answer to a step."""

    sampler_output: SamplerOutput | None = None
    generator_states: dict[str, torch.Tensor] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)  # request id -> its block's error
    step_error: str | None = None  # the forward itself failed: run it again without `blamed`
    blamed: list[str] = field(default_factory=list)


class NNsightShardRunner(NNsightGPUModelRunner, ShardRunner):
    """A rank's shard with the nnsight bridge's runner around it, served by its front end's exchanges."""

    def value_fragments(self) -> Any:
        _offer_plan_matcher_where_nnsight_looks()
        return RankFragments()

    def envoy_classes(self) -> Any:
        return tp_envoys()

    def tp_plan_overrides(self) -> dict[str, str]:
        """The input embedding whole on every rank.

        transformers 5.23 shards it over the vocabulary by default; its value at the handoff is then a
        masked partial sum whose mask DTensor has already released, which nnsight cannot make whole
        (an AssertionError in torch's reduction). Kept whole, `embed_tokens.output` is HF's tensor on
        every rank, at the cost of one embedding table per rank (and, with tied weights, the whole head).
        """
        skeleton = self._skeleton()
        embedding, head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
        whole = [embedding]
        if head is not None and getattr(head, "weight", None) is embedding.weight:
            whole.append(head)  # tied: one table, so the head is whole too (each rank computes every logit)
        return {name: "replicated_with_grad_allreduce" for name, module in skeleton.named_modules() if module in whole}

    def _skeleton(self) -> torch.nn.Module:
        """The whole model on the meta device, no weights: what each module's values look like unsplit (built once)."""
        if getattr(self, "skeleton", None) is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            model_config = self.config.model
            config = AutoConfig.from_pretrained(
                model_config.model, revision=model_config.revision, trust_remote_code=model_config.trust_remote_code
            )
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(
                    config, dtype=self.config.device.torch_dtype, trust_remote_code=model_config.trust_remote_code
                )
            skeleton.set_attn_implementation(ATTN_IMPLEMENTATION)
            self.skeleton = skeleton.eval()
        return self.skeleton

    def load_model(self) -> None:
        super().load_model()
        add_generator(self.nnsight_model)  # blocks reach `model.generator` on the rank's tree
        fragments = self.interleaver.fragments
        fragments.interleaver = self.interleaver
        fragments.learn_split_values(self.model, self._skeleton())
        self.skeleton = None  # only needed at load
        self.rank_envoys = RankEnvoys(self.nnsight_model)
        self.mirrors: dict[str, Request] = {}  # request id -> this rank's copy of a traced request

    def serve_exchange(self, message: dict) -> bytes | None:
        if message["op"] not in ("step", "finish"):  # an extraction's prefill: the shard runner's own
            return super().serve_exchange(message)
        self._receive(message["jobs"])
        if message["op"] == "step":
            answer = self._step(message)
        else:
            answer = self._finish(message["requests"])
        return answer if dist.get_rank() == 0 else None

    def _receive(self, payloads: list[bytes]) -> None:
        for job in receive_jobs(payloads, self.rank_envoys, self.device):
            self.mirrors.update(job.requests)

    # ---- a step ------------------------------------------------------------------------------
    def _step(self, message: dict) -> bytes:
        forward_batch = wire.decode_step(message["step"], self.allocator.page_size)
        forward_batch.reqs = [
            self._row_request(row, shipped) for row, shipped in zip(message["rows"], forward_batch.reqs)
        ]
        forward_batch.next_token_logits_rows = message["next_token_logits_rows"]
        forward_batch.prompt_logits_rows = message["prompt_logits_rows"]
        self.eos_token_ids = message["eos_token_ids"]
        try:
            logits_output = self.forward(forward_batch)
            sampler_output = self.sample(logits_output, forward_batch)
        except Exception as error:  # every rank fails alike: each ran the same blocks on the same values
            blamed = [req.request_id for req in self.requests_to_blame(forward_batch.reqs)]
            where = traceback.format_exc(limit=-3)  # the rank's innermost frames: where the forward failed
            return pickle.dumps(StepAnswer(step_error=f"{type(error).__name__}: {error}\n{where}", blamed=blamed))
        answer = StepAnswer(_on_cpu(sampler_output))
        for req in forward_batch.reqs:
            if req.generator is not None:
                answer.generator_states[req.request_id] = req.generator.get_state()
            if req.error is not None:
                answer.failed[req.request_id] = portable_error(req.error)
        return pickle.dumps(answer)

    def _row_request(self, row: StepRow, shipped: Any) -> Request:
        req = self.mirrors.get(row.request_id)
        if req is None:
            req = Request(row.request_id, row.prompt_token_ids, row.sampling_params, extra_args=row.extra_args)
        req.output_token_ids = row.output_token_ids
        req.num_computed_tokens = row.num_computed_tokens
        req.page_ids = shipped.page_ids
        req.error = None  # failures are the front end's to keep; a step reports only its own
        req.generator = None
        if row.generator_state is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.set_state(row.generator_state)
        return req

    # ---- finishing ---------------------------------------------------------------------------
    def _finish(self, finished: list[tuple[str, list[int]]]) -> bytes:
        reqs = []
        for request_id, output_token_ids in finished:
            req = self.mirrors.pop(request_id, None)
            if req is not None:
                req.output_token_ids = output_token_ids
                req.status = RequestStatus.FINISHED
                reqs.append(req)
        helper = self.nnsight_requests
        invocations = helper.process_finished_reqs(reqs)
        helper.finish(invocations)
        return ship_results(invocations)


def _offer_plan_matcher_where_nnsight_looks() -> None:
    """nnsight 0.8.1's `TPFragments` imports transformers' plan matcher from `tensor_parallel`, where
    transformers up to 5.22 kept it; 5.23 moved it to `parallel_utils` (same function). Offered at
    the old name too, so nnsight resolves each module's parallel style with transformers' own rule."""
    from transformers.distributed import parallel_utils, tensor_parallel

    if not hasattr(tensor_parallel, "_get_parameter_plan"):
        tensor_parallel._get_parameter_plan = parallel_utils._get_parameter_plan


def _on_cpu(output: SamplerOutput) -> SamplerOutput:
    def cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.detach().cpu()

    return SamplerOutput(
        cpu(output.token_ids),
        cpu(output.logprobs),
        cpu(output.top_logprob_ids),
        cpu(output.top_logprobs),
        dict(output.row_errors),
    )
