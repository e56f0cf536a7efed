"""One extraction engine as a Ray actor: an nnrun engine that turns a range of prompts into a shard's rows.

The actor holds the same `ExtractionJob` a single-process run builds, so a range (one planned
shard) goes through the same forward batches in the same order and comes out as the same rows.
It keeps no state between ranges that shapes the rows, so Ray may restart it and retry a range
at any point (a killed worker, a lost node) and the range comes out the same.

With `tensor_parallel_size` N > 1 the engine is a tensor-parallel front end: it spawns its N
rank processes on its own node, exactly as a single-process job does (the actor holds the N
devices, see cluster.py). A rank that dies, hangs or raises fails the range with the group's
`TensorParallelError` naming the rank; the engine then starts a new group before its next range,
so Ray's retry of the range (`retry_exceptions`, executor.py) runs it on fresh ranks.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nnrun.extract.inputs import PromptSource
from nnrun.extract.job import ExtractionJob, ExtractionOptions, as_llm
from nnrun.extract.plan import ShardPlan
from nnrun.extract.prepare import LengthPolicy, PreparedPrompt
from nnrun.extract.progress import Progress
from nnrun.extract.shards import ShardBuffer


@dataclass(frozen=True)
class JobDescription:
    """What the driver needs to plan and open the folder, as the engines see the job."""

    settings: dict[str, Any]
    model_info: dict[str, Any]
    tokenizer: Any
    vocab_size: int
    length_policy: LengthPolicy


@dataclass(frozen=True)
class RangeInfo:
    """A finished range: which process made its rows, in how long (the rows travel as a second object)."""

    number: int  # the range's place in the job's plan
    pid: int
    elapsed_s: float


@dataclass(frozen=True)
class RangeProgress:
    """How far an engine is into the range it runs: counted per forward batch, read by the driver's polls."""

    number: int
    num_prompts: int
    num_tokens: int


@dataclass(frozen=True)
class EngineSpec:
    """How to build each engine: what `nnrun.extract` would build in one process."""

    model: Any  # anything nnrun.LLM accepts but an LLM itself (an in-memory model travels pickled)
    tokenizer: Any
    llm_kwargs: dict[str, Any]
    modules: list[str] | str
    options: ExtractionOptions
    text_field: str
    limit: int | None
    num_threads: int | None  # CPU float results depend on torch's thread count; None: leave it


class ExtractionEngine:
    """The actor class (wrapped by `ray.remote` in executor.py): build an engine once, then run ranges."""

    def __init__(self, spec: EngineSpec) -> None:
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)  # with N ranks, each rank gets 1/N of them (RankGroup)
        self.spec = spec
        self._build()
        self._current: int | None = None  # the range being run, for status()
        # Counts of the current range, bumped by run_shard after each forward (two int additions, no
        # call out of the process): the driver polls them on the control thread to move its bars.
        self._progress = Progress(False, None)
        self._lock = threading.Lock()

    def _build(self) -> None:
        """The engine and its job (with N > 1 ranks, this spawns them on this node)."""
        spec = self.spec
        self.llm, _ = as_llm(spec.model, spec.tokenizer, spec.llm_kwargs, progress=False)
        # The engine reads no input: the driver does, and sends each range's token ids.
        source = PromptSource("iterable", "prompts", spec.text_field, spec.limit, lambda: iter(()))
        self.job = ExtractionJob(self.llm, source, spec.modules, Path(os.devnull), spec.options)

    def _replace_failed_group(self) -> None:
        """A tensor-parallel group that failed (its ranks are already stopped) is replaced by a new one."""
        if self.llm.runner.failure() is None:
            return
        self.llm.shutdown()
        self._build()

    def describe(self) -> JobDescription:
        return JobDescription(
            self.job.settings(), self.job.model_info(), self.llm.tokenizer, self.llm.vocab_size, self.job.length_policy
        )

    def run_range(self, number: int, prompts: list[PreparedPrompt]) -> tuple[RangeInfo, ShardBuffer]:
        """Forward one planned shard's prompts; the rows come back packed on the host.

        Called with `num_returns=2`: the driver waits on the small RangeInfo while the rows stay
        in Ray's object store (which spills to disk) until their turn to be committed.
        """
        self._replace_failed_group()  # this call may be Ray's retry of the range a rank failed
        progress = Progress(False, None)
        with self._lock:
            self._current, self._progress = number, progress
        start = time.perf_counter()
        try:
            buffer = self.job.run_shard(ShardPlan(prompts=prompts), progress)
        finally:
            with self._lock:
                self._current = None
        return RangeInfo(number, os.getpid(), time.perf_counter() - start), buffer.packed()

    def status(self) -> tuple[int, int | None]:
        """(this process's pid, the range it is running or None); answers while a range runs."""
        with self._lock:
            return os.getpid(), self._current

    def progress(self) -> RangeProgress | None:
        """The running range's prompts and tokens forwarded so far, or None between ranges; a control-group call."""
        with self._lock:
            if self._current is None:
                return None
            return RangeProgress(self._current, self._progress.num_prompts, self._progress.num_tokens)

    def rank_pids(self) -> list[int]:
        """The pids of this engine's tensor-parallel ranks (none with one device); a control-group call."""
        group = getattr(self.llm.runner, "group", None)
        return [] if group is None else [process.pid for process in group.processes]

    def shutdown(self) -> None:
        self.llm.shutdown()
