"""One tensor-parallel rank: its shard of the model, its own KV pool, and a loop that runs the steps it is sent.

Every rank runs the same forward over the same packed batch; transformers' plan does the
collectives inside it (an all-reduce after each row-parallel projection, an all-gather of the
logits). On CUDA each rank captures its own decode graphs, collectives included, and every rank
decides whether a step replays one from the same step message and the same state (see
`ShardRunner.init_cuda_graphs`), so the ranks' collectives always pair up. Only rank 0 answers the front end. A rank that fails reports its traceback and exits:
the others then fail in their next collective, and the front end stops the whole group.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import signal
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

import nnrun.tp.wire as wire
from nnrun.config import EngineConfig
from nnrun.cuda_graph import GraphCapturer
from nnrun.extract.hooks import ActivationCapture
from nnrun.model_runner import ModelRunner
from nnrun.sampler import SamplerOutput, row_argmax
from nnrun.tp.profiling import CollectiveTimer

PARENT_POLL_S = 0.5  # how often a rank checks that its front end is still alive
# A rank's collectives wait this much longer than the front end waits for a step, so that a hung
# peer is reported by the front end as a hang (and the group stopped), not by rank 0 as a timeout.
COLLECTIVE_TIMEOUT_FACTOR = 1.5
DEFAULT_RANK_RUNNER = "nnrun.tp.worker:ShardRunner"


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to join its group (picklable: it crosses the spawn)."""

    rank: int
    world_size: int
    store_port: int
    checkpoint: str  # a resolved checkpoint folder or hub id
    config: EngineConfig  # the front end's config, without its tokenizer
    timeout_s: float  # the front end's step timeout; collectives give up a little later (the front end speaks first)
    num_threads: int  # torch threads on a CPU rank
    # "module:Class" of the rank's runner (a `ShardRunner`): named, not imported, so that the engine
    # never imports the nnsight bridge, whose front-end runner asks for its own rank runner.
    rank_runner: str = DEFAULT_RANK_RUNNER


class ShardRunner(ModelRunner):
    """A `ModelRunner` over this rank's shard: loads through transformers' TP plan, agrees on the KV pool size."""

    def initialize(self) -> None:
        """The packed path on every rank: no per-rank choice of path (ranks must never take different ones)."""
        self.load_model()
        if getattr(self, "packed_unfit", None):
            raise ValueError(
                f"{type(self.model).__name__} needs nnrun's exact path ({self.packed_unfit}), which is "
                "not served on tensor-parallel ranks yet; run it with tensor_parallel_size=1"
            )
        self.init_memory_pool()
        self.init_attention_backend()
        self.init_cuda_graphs()

    def init_cuda_graphs(self, capturer: GraphCapturer | None = None) -> None:
        """Each rank captures its own decode graphs for the same sizes, in the same order.

        A graph holds the step's collectives (NCCL on CUDA; the warm-up before each capture runs them
        eagerly first), so a step must replay on every rank or on none. Every rank decides it alike:
        from the step message they all receive (mode, batch size, attention probabilities) and from
        state every rank changes alike (each runs the same nnsight blocks and extraction hooks).
        """
        if not self.config.parallel.tensor_parallel_cuda_graphs:
            return  # opt-in (ParallelConfig.tensor_parallel_cuda_graphs): the ranks decode eagerly
        self._agree_on_attention_backend()
        try:
            super().init_cuda_graphs(capturer)
        except RuntimeError as error:
            raise RuntimeError(
                f"capturing the decode CUDA graphs of a tensor-parallel rank failed ({type(error).__name__}: "
                f"{error}); run with enable_cuda_graphs=False to decode eagerly on the ranks"
            ) from error

    def _agree_on_attention_backend(self) -> None:
        """Whether and which graphs a rank captures follows from the config every rank was sent and from
        its attention backend, which each rank chose for itself: they must have chosen the same one, or
        their captures' warm-up collectives would not pair up."""
        mine = (self.attn_backend.name, self.attn_backend.supports_cuda_graphs)
        every_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, mine)
        if any(theirs != mine for theirs in every_rank):
            raise RuntimeError(
                f"the tensor-parallel ranks chose different attention backends ((name, runs in CUDA graphs) per "
                f"rank: {every_rank}); pick one with attention_backend=..."
            )

    def load_model(self) -> None:
        """This rank's shard, read by transformers through the model's TP plan, then loaded as any in-memory model."""
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        model_config = self.config.model
        model_config.model = AutoModelForCausalLM.from_pretrained(
            model_config.model,
            dtype=self.config.device.torch_dtype,
            revision=model_config.revision,
            trust_remote_code=model_config.trust_remote_code,
            distributed_config=DistributedConfig(
                tp_plan=self.tp_plan_overrides() or "auto", tp_size=dist.get_world_size()
            ),
        )
        super().load_model()  # every rank runs the same load-time probes in step: their collectives pair up

    @staticmethod
    def gather_heads(probs: torch.Tensor) -> torch.Tensor:
        """Attention probabilities `[1, Hq_local, n, L]` of every rank, in rank (head) order: `[1, Hq, n, L]`."""
        pieces = [torch.empty_like(probs) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, probs.contiguous())
        return torch.cat(pieces, dim=1)

    def tp_plan_overrides(self) -> dict[str, str] | None:
        """Entries that replace the model's own TP plan for these ranks (None: the plan as published)."""
        return None

    def _build_kv_cache(self, num_pages: int) -> None:
        """Every rank holds the same pages (the front end's allocator hands out one set): the smallest budget wins."""
        agreed = torch.tensor([num_pages], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        super()._build_kv_cache(int(agreed.item()))

    def sample(self, logits_output, forward_batch):
        """Rank 0 samples (one sampler decides, as with one rank); every rank gets its tokens.

        Only a rank runner that samples calls this (the nnsight bridge's, whose blocks read and edit
        `model.samples` on every rank and must see the same tokens there).
        """
        if dist.get_rank() == 0:
            output = super().sample(logits_output, forward_batch)
        else:
            rows = logits_output.next_token_logits.shape[0]
            output = SamplerOutput(torch.zeros(rows, dtype=torch.int64, device=self.device), None, None, None)
        token_ids = output.token_ids.to(self.device).contiguous()  # [B]
        dist.broadcast(token_ids, src=0)
        output.token_ids = token_ids
        return output

    def serve_exchange(self, message: dict) -> bytes | None:
        """A runner's own message from its front end (`RankGroup.exchange`, unpickled); rank 0's answer goes back."""
        if message["op"] != "prefill":
            raise ValueError(f"{type(self).__name__} serves no {message['op']!r} exchange")
        return pickle.dumps(self.prefill_capturing(message))

    def prefill_capturing(self, message: dict) -> dict[str, torch.Tensor]:
        """An extraction's prefill: every rank runs it, rank 0's hooks keep the values (each `[N, ...]`, on the CPU)."""
        forward_batch = wire.decode_step(message["step"], self.allocator.page_size)
        forward_batch.next_token_logits_rows = []
        forward_batch.prompt_logits_rows = [None] * forward_batch.batch_size
        with ActivationCapture(self.model, message["specs"], message["dtype"]) as capture:
            self.run_model(forward_batch)
            values = capture.take(forward_batch.num_tokens)
        return {name: value.cpu() for name, value in values.items()}


def run_rank(spec: RankSpec, conn: Connection, parent_pid: int) -> None:
    """The rank process: join the group, load, report ready, then run steps until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle; it stops the ranks
    _exit_when_orphaned(parent_pid)
    try:
        runner = _start(spec)
        graphs = runner.path.graphs
        info = {
            "layers": runner.layers,
            "num_pages": runner.kv_pool.num_pages,
            "max_model_len": runner.max_model_len,
            "cuda_graph_batch_sizes": None if graphs is None else graphs.batch_sizes,
        }
        conn.send_bytes(wire.encode_report(wire.MessageKind.READY, info if spec.rank == 0 else {}))
        _serve_steps(runner, conn, spec.rank)
    except BaseException:
        _report(conn, spec.rank, traceback.format_exc())
        os._exit(1)  # a collective may still be in flight on another thread of gloo: leave at once
    _leave_group()


def _start(spec: RankSpec) -> ShardRunner:
    device = _claim_device(spec)
    _join_group(spec, device)
    device_config = dataclasses.replace(spec.config.device, device=device)
    device_config.torch_dtype = spec.config.device.torch_dtype
    config = dataclasses.replace(spec.config, device=device_config)
    config.model.model = spec.checkpoint
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # no progress bar per rank (its lock would be a semaphore left behind by a killed rank)
    module_name, class_name = spec.rank_runner.split(":")
    runner = getattr(importlib.import_module(module_name), class_name)(config)
    runner.initialize()
    return runner


def _claim_device(spec: RankSpec) -> str:
    """This rank's device: GPU `rank` on CUDA, else the CPU with its share of the threads."""
    # transformers binds each rank to its device by these (torchrun's) variables
    os.environ.update(RANK=str(spec.rank), LOCAL_RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size))
    if spec.config.device.device.startswith("cuda"):
        device = f"cuda:{spec.rank}"
        torch.cuda.set_device(device)
        return device
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: transformers must not build its mesh on a GPU
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks share this machine: loopback only
    torch.set_num_threads(spec.num_threads)
    return "cpu"


def _join_group(spec: RankSpec, device: str) -> None:
    timeout = timedelta(seconds=spec.timeout_s * COLLECTIVE_TIMEOUT_FACTOR)
    store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False, timeout=timeout)
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=dist.PrefixStore("nnrun-tp", store),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timeout,
    )


def _serve_steps(runner: ShardRunner, conn: Connection, rank: int) -> None:
    page_size = runner.allocator.page_size
    timer: CollectiveTimer | None = None
    while True:
        message = conn.recv_bytes()  # EOFError when the front end is gone: the rank exits
        kind = wire.message_kind(message)
        if kind is wire.MessageKind.STOP:
            return
        if kind is wire.MessageKind.PROFILE_START:
            timer = CollectiveTimer(runner.device)
            continue
        if kind is wire.MessageKind.PROFILE_STOP:
            stats = timer.stop() if timer is not None else {}
            timer = None
            if rank == 0:
                conn.send_bytes(wire.encode_report(wire.MessageKind.STATS, stats))
            continue
        if kind is wire.MessageKind.EXCHANGE:
            answer = runner.serve_exchange(pickle.loads(wire.exchange_payload(message)))
            if rank == 0:
                conn.send_bytes(wire.encode_exchange(wire.MessageKind.EXCHANGE_REPLY, answer or b""))
            continue
        forward_batch = wire.decode_step(message, page_size)
        logits = runner.run_model(forward_batch)  # [R, V], every rank
        if rank != 0:
            continue
        if wire.step_reply(message) is wire.StepReply.ARGMAX:  # as the front end's sampler picks a greedy row
            reply = wire.encode_tensor(wire.MessageKind.TOKEN_IDS, row_argmax(logits.float()))  # [R]
        else:
            reply = wire.encode_tensor(wire.MessageKind.LOGITS, logits)
        for part in reply:
            conn.send_bytes(part)


def _report(conn: Connection, rank: int, text: str) -> None:
    try:
        conn.send_bytes(wire.encode_error(rank, text))
    except OSError:
        pass  # the front end is gone: nobody to tell


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_when_orphaned(parent_pid: int) -> None:
    """A rank never outlives its front end, even one killed outright (no pipe EOF reaches a rank inside a collective)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="nnrun-tp-parent-watch", daemon=True).start()
