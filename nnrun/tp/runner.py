"""TensorParallelRunner: the front end's runner when the weights live on N rank processes.

It keeps everything the scheduler and the caller see (the request table, the page allocator,
the tokenizer, the model's module tree on the meta device, the sampler) and sends each step
to the ranks, which hold the weights and the KV. One scheduler and one sampler decide for all
ranks, so seeded sampling gives the same tokens as with one rank.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

import nnrun.tp.wire as wire
from nnrun.config import EngineConfig
from nnrun.extract.hooks import ModuleSpec
from nnrun.forward_batch import ForwardBatch
from nnrun.loader import _load_tokenizer, _resolve_path, check_model_supported
from nnrun.memory import ReqToTokenPool, TokenToKVPoolAllocator
from nnrun.model_runner import LogitsProcessorOutput, ModelRunner
from nnrun.request import Request
from nnrun.sampler import SamplerOutput
from nnrun.tp.capture import refuse_split_values
from nnrun.tp.group import RankGroup
from nnrun.tp.plan import check_tensor_parallel_plan
from nnrun.tp.worker import DEFAULT_RANK_RUNNER


class TensorParallelRunner(ModelRunner):
    """A `ModelRunner` whose forward runs on `tensor_parallel_size` rank processes."""

    captures_on_ranks = True  # extraction's hooks run on rank 0's modules (`run_prefill_capturing`)

    rank_runner = DEFAULT_RANK_RUNNER  # the runner each rank runs ("module:Class"); subclasses name their own

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.device = torch.device("cpu")  # the front end samples on the CPU; the ranks own the devices
        self.group: RankGroup | None = None
        self.num_steps_sampled_on_rank0 = 0  # steps whose tokens came back as argmaxes, without their logits
        self._whole_specs: set[tuple] = set()  # extraction specs found whole on the ranks (`refuse_split_values`)
        self.rank_graph_batch_sizes: list[int] | None = None

    def initialize(self) -> None:
        self.load_model()
        self.group = RankGroup(self.config, self.checkpoint, self.rank_runner)
        try:
            report = self.group.wait_ready()
        except BaseException:
            self.group.stop()
            raise
        self.layers = report["layers"]  # rank 0's: its own share of the heads
        self.max_model_len = report["max_model_len"]
        # Decode steps the ranks may replay as CUDA graphs (None: every step runs eagerly there)
        self.rank_graph_batch_sizes = report["cuda_graph_batch_sizes"]
        self._build_kv_cache(report["num_pages"])
        self.attn_backend = None

    def load_model(self) -> None:
        """The module tree on the meta device (no weights), checked against transformers' TP plan."""
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        model_config = self.config.model
        tp_size = self.config.parallel.tensor_parallel_size
        _refuse_sources_without_checkpoint(model_config.model, model_config.load_format, tp_size)
        _check_devices(self.config.device.device, tp_size)
        if importlib.util.find_spec("accelerate") is None:
            raise ValueError(
                f"tensor_parallel_size={tp_size} needs the accelerate package (transformers shards a "
                "checkpoint over ranks with it): pip install 'nnrun[tp]'"
            )
        self.checkpoint = _resolve_path(model_config.model)
        self.model_name = model_config.model
        try:
            hf_config = AutoConfig.from_pretrained(
                self.checkpoint, revision=model_config.revision, trust_remote_code=model_config.trust_remote_code
            )
        except OSError as error:
            raise ValueError(
                f"could not load model {model_config.model!r}: it is not a local checkpoint folder, "
                f"not a bundled model, and the HF hub did not provide it: {error}"
            ) from error
        check_model_supported(hf_config)
        self.dtype = self.config.device.torch_dtype
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(
                hf_config, dtype=self.dtype, trust_remote_code=model_config.trust_remote_code
            )
        check_tensor_parallel_plan(self.model, tp_size)
        if os.path.isfile(os.path.join(self.checkpoint, "generation_config.json")):
            self.model.generation_config = GenerationConfig.from_pretrained(self.checkpoint)
        self.tokenizer = _load_tokenizer(model_config.tokenizer, self.checkpoint, model_config)

    def _build_kv_cache(self, num_pages: int) -> None:
        """Only the bookkeeping: the pages themselves live on the ranks, one pool each for its heads."""
        page_size = self.config.cache.page_size
        self.kv_pool = None
        self.allocator = TokenToKVPoolAllocator(num_pages, page_size)
        self.max_total_tokens = num_pages * page_size
        self.req_to_token_pool = ReqToTokenPool(
            self.config.scheduler.max_num_seqs + 1, min(self.max_model_len, self.max_total_tokens)
        )

    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        page_size = self.allocator.page_size
        if _is_plain_greedy_step(forward_batch):  # only argmaxes cross, not R x V logits
            token_ids = self.group.run_step(wire.encode_step(forward_batch, page_size, wire.StepReply.ARGMAX))  # [B]
            self.num_steps_sampled_on_rank0 += 1
            return RankSampledOutput(next_token_logits=torch.empty((len(token_ids), 0)), token_ids=token_ids)
        logits = self.group.run_step(wire.encode_step(forward_batch, page_size))  # [R, V]
        return self.process_logits(logits, forward_batch)

    def allows_multi_step(self, reqs: list[Request]) -> bool:
        """Every step is a round trip to the ranks already: they take one step per scheduling decision."""
        return False

    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> SamplerOutput:
        if isinstance(logits_output, RankSampledOutput):
            return SamplerOutput(logits_output.token_ids, None, None, None)
        return super().sample(logits_output, forward_batch)

    def failure(self) -> BaseException | None:
        """Why the ranks can no longer run steps (a rank died, hung or raised), or None."""
        return None if self.group is None else self.group.failure

    def run_model(self, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.group.run_step(wire.encode_step(forward_batch, self.allocator.page_size))

    @contextmanager
    def profile_collectives(self) -> Iterator[dict[str, float]]:
        """Time rank 0's collectives over the steps run inside the `with` block (for benchmarks).

        The dict it yields is filled when the block ends: `wall_s`, `collective_s`, `num_collectives`.
        """
        stats: dict[str, float] = {}
        with self.step_lock:  # windows open and close between steps
            self.group.start_profile()
        try:
            yield stats
        finally:
            with self.step_lock:
                stats.update(self.group.stop_profile())

    def run_prefill_only(self, token_id_lists: list[list[int]]) -> ForwardBatch:
        raise NotImplementedError(
            "run_prefill_only with tensor_parallel_size > 1: module hooks registered here would not run (the "
            "forward runs on the ranks); extraction uses run_prefill_capturing, which hooks the ranks' modules"
        )

    def run_prefill_capturing(
        self, token_id_lists: list[list[int]], specs: list[ModuleSpec], dtype: torch.dtype
    ) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        """One packed prefill on the ranks; each spec's flat `[N, ...]` value from rank 0 (whole values only)."""
        if tuple(specs) not in self._whole_specs:  # checked once per job's specs, not per batch
            refuse_split_values(self.model, specs, self.config.parallel.tensor_parallel_size)
            self._whole_specs.add(tuple(specs))
        with self.step_lock, self._transient_requests(token_id_lists) as reqs:
            forward_batch = self.prepare_forward_batch_extend(reqs)
            forward_batch.logits_indices = torch.zeros(0, dtype=torch.int64)
            message = {
                "op": "prefill",
                "step": bytes(wire.encode_step(forward_batch, self.allocator.page_size)),
                "specs": specs,
                "dtype": dtype,
            }
            return forward_batch, pickle.loads(self.group.exchange(pickle.dumps(message)))

    def shutdown(self) -> None:
        """Stop every rank (called as the engine thread ends, or by `LLM.shutdown`)."""
        super().shutdown()
        if self.group is not None:
            self.group.stop()


@dataclass
class RankSampledOutput(LogitsProcessorOutput):
    """A step whose tokens rank 0 picked (the argmax of each row); no logits crossed."""

    token_ids: torch.Tensor | None = None  # [B] int64


def _is_plain_greedy_step(forward_batch: ForwardBatch) -> bool:
    """Every row's token is the argmax of its float32 logits, and nothing else is asked of them.

    Greedy, no penalties, no logprobs of either kind, past `min_tokens` (so no stop token is
    masked): the front end's sampler would return `logits.float().argmax(-1)`, which rank 0
    computes over the same values instead.
    """
    if len(forward_batch.logits_indices) != forward_batch.batch_size:
        return False
    for req in forward_batch.reqs:
        params = req.sampling_params
        if (
            not params.is_greedy
            or params.has_penalties
            or params.logprobs is not None
            or params.prompt_logprobs is not None
            or len(req.output_token_ids) < params.min_tokens
        ):
            return False
    return True


def _refuse_sources_without_checkpoint(source: Any, load_format: str, tp_size: int) -> None:
    """Each rank reads its own shard from the checkpoint: an in-memory model or dummy weights have none."""
    if not isinstance(source, str):
        raise ValueError(
            f"tensor_parallel_size={tp_size} loads each rank's shard from a checkpoint; got an in-memory "
            f"{type(source).__name__}. Save it first (model.save_pretrained(folder)) and pass the folder"
        )
    if load_format != "auto":
        raise ValueError(
            f"tensor_parallel_size={tp_size} with load_format={load_format!r} is not supported: each rank reads "
            "its shard from a checkpoint. Save a randomly initialised model with save_pretrained and pass the folder"
        )


def _check_devices(device: str, tp_size: int) -> None:
    """Rank r runs on GPU r (choose the GPUs with CUDA_VISIBLE_DEVICES), or on this machine's CPU."""
    if device not in ("cpu", "cuda"):
        raise ValueError(
            f"tensor_parallel_size={tp_size} runs on device='cpu' or device='cuda' (rank r on GPU r; "
            f"pick the GPUs with CUDA_VISIBLE_DEVICES), got device={device!r}"
        )
    if device == "cuda" and torch.cuda.device_count() < tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} needs {tp_size} GPUs, one per rank; this machine shows "
            f"{torch.cuda.device_count()}"
        )


def tensor_parallel_runner_class(runner_cls: type[ModelRunner]) -> type[ModelRunner]:
    """The runner for `tensor_parallel_size > 1`; refuses runners whose features the ranks do not serve yet.

    A front-end runner of its own (a `TensorParallelRunner` subclass, such as the nnsight bridge's) is used as is.
    """
    if issubclass(runner_cls, TensorParallelRunner):
        return runner_cls
    if runner_cls is not ModelRunner:
        raise NotImplementedError(
            f"{runner_cls.__name__} is not served on tensor-parallel ranks: a runner needs a tensor-parallel "
            "front end (a TensorParallelRunner subclass) to run there. For nnsight traces use "
            "nnrun.LanguageModel(..., tensor_parallel_size=N) or nnrun.VLLM(..., tensor_parallel_size=N)"
        )
    return TensorParallelRunner
