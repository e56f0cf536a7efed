"""`nnrun.extract(..., executor="ray")`: one job's shards spread over engine actors, committed in input order.

The driver (this process) does what a single-process job does around the forwards: it opens or
resumes the folder (job.run_in_folder, resume.py), reads and tokenizes the input and plans the
shards (plan.py). Each planned shard is a *range*: an idle engine pulls the next one and runs its
forward batches exactly as a single process would, so its rows are the same bytes. Ranges finish
in any order; a finished range's rows wait in Ray's object store until every range before it is
committed, then the driver commits it through the same ShardCommitter. The folder is therefore
always a prefix of the single-process folder (a killed driver resumes like a killed job), and
complete, it is that folder byte for byte, whatever the number of engines.

Faults are Ray's: an engine whose process dies is restarted (`max_restarts`) and the range it was
running is sent again (`max_task_retries`). An engine of N tensor-parallel ranks whose group fails
(a rank died, hung or raised) raises `TensorParallelError`, which Ray retries the same way
(`retry_exceptions`) on the engine's new group. Nothing here retries by hand.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nnrun.distributed.cluster import RayExecutor, connect, start_engines, uses_gpus
from nnrun.distributed.engine import EngineSpec, ExtractionEngine, JobDescription
from nnrun.distributed.monitor import EngineMonitor
from nnrun.distributed.progress import EngineProgress
from nnrun.extract.committer import ShardCommit, ShardCommitter
from nnrun.extract.job import ExtractionOptions, run_in_folder, stop_error
from nnrun.extract.manifest import Manifest, settings_diff
from nnrun.extract.plan import HashedRecords, ShardPlan, plan_shards
from nnrun.extract.prepare import prepare_prompts
from nnrun.extract.progress import ExtractionSummary
from nnrun.tp.group import TensorParallelError

if TYPE_CHECKING:
    from nnrun.extract.executors import ExtractionRequest

__all__ = ["RayExecutor", "extract_on_ray"]


@dataclass(frozen=True)
class RayRunner:
    """The extraction executor (`run(request)`) for a RayExecutor's settings."""

    settings: RayExecutor

    def run(self, request: ExtractionRequest) -> ExtractionSummary:
        return extract_on_ray(request, self.settings)


def ray_runner(executor: Any, num_engines: int | None, address: str | None, verbose: bool) -> RayRunner:
    """The runner for `extract`'s executor="ray" or a RayExecutor, with num_engines/ray_address/verbose applied."""
    if isinstance(executor, RayExecutor):
        changes = {"num_engines": num_engines, "address": address, "verbose": verbose or None}
        settings = replace(executor, **{name: value for name, value in changes.items() if value is not None})
    elif executor == "ray":
        settings = RayExecutor(num_engines=1 if num_engines is None else num_engines, address=address, verbose=verbose)
    else:
        raise ValueError(
            f"executor must be 'local', 'ray', a RayExecutor or an object with run(request), got {executor!r}"
        )
    return RayRunner(settings)


def extract_on_ray(request: ExtractionRequest, executor: RayExecutor) -> ExtractionSummary:
    """Run the job on `executor.num_engines` engine actors; the folder is what one process would write."""
    model, tokenizer, llm_kwargs = request.model, request.tokenizer, request.llm_kwargs
    source, modules, out_dir, options = request.source, request.modules, request.out_dir, request.options
    from nnrun.engine import LLM

    if isinstance(model, LLM):
        raise ValueError(
            "executor='ray' builds one engine per actor: pass the model (a name, path or module) "
            "and llm_kwargs, not an nnrun.LLM"
        )
    import ray

    has_connected = connect(executor.address)
    engines: list[Any] = []
    try:
        has_gpus = uses_gpus(llm_kwargs or {})
        tp_size = (llm_kwargs or {}).get("tensor_parallel_size", 1)
        spec = EngineSpec(
            model,
            tokenizer,
            dict(llm_kwargs or {}),
            modules,
            options,
            source.text_field,
            source.limit,
            num_threads=None if has_gpus else executor.cpus_per_engine * tp_size,  # cpus_per_engine per rank
        )
        engines = start_engines(ExtractionEngine, spec, executor, has_gpus, tp_size)
        if executor.on_engines is not None:
            executor.on_engines(list(engines))
        description = _describe(engines)
        driver = RangeDriver(
            engines, description, out_dir, options, executor.window, executor.poll_interval_s, executor.max_task_retries
        )
        make_progress = partial(EngineProgress, num_engines=len(engines), verbose=executor.verbose)
        return run_in_folder(
            out_dir, description.settings, description.model_info, source, options, driver.extract_rest, make_progress
        )
    finally:
        _kill_engines(engines)
        if has_connected:
            ray.shutdown()


def _kill_engines(engines: list[Any], timeout_s: float = 30.0) -> None:
    """Kill the engine actors (also ending ranges still running after a failure) and wait until each is gone:
    `ray.kill` only asks, and a call that reaches an engine before the kill does is still served."""
    import ray

    for engine in engines:
        ray.kill(engine)
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        while time.monotonic() < deadline:
            try:
                ray.get(engine.rank_pids.options(concurrency_group="control").remote(), timeout=1.0)
            except ray.exceptions.RayActorError:
                break  # gone
            except ray.exceptions.GetTimeoutError:
                continue
            time.sleep(0.05)


def _describe(engines: list[Any]) -> JobDescription:
    """The job as the engines see it; every engine must see the same (same weights, tokenizer, settings)."""
    import ray

    descriptions = ray.get([engine.describe.remote() for engine in engines])
    first = descriptions[0]
    for i, other in enumerate(descriptions[1:], start=1):
        diffs = settings_diff(first.settings, other.settings)
        if diffs:
            raise ValueError(
                f"engine {i} differs from engine 0 ({'; '.join(diffs)}): every node must hold the "
                "same model files and library versions"
            )
    return first


@dataclass
class PendingRange:
    """A planned range, from its dispatch until its commit."""

    number: int
    plan: ShardPlan
    input_sha256: str  # digest of the input up to plan.end, taken in plan order
    info_ref: Any = None  # ObjectRef of the engine's RangeInfo; None for a stretch of skipped items only
    rows_ref: Any = None  # ObjectRef of the ShardBuffer
    is_done: bool = False


class RangeDriver:
    """Hand ranges to idle engines and commit finished ones in plan order, at most `window` uncommitted."""

    def __init__(
        self,
        engines: list[Any],
        description: JobDescription,
        out_dir: Path,
        options: ExtractionOptions,
        window: int,
        poll_interval_s: float,
        max_task_retries: int = 0,
    ) -> None:
        self.engines = engines
        self.description = description
        self.out_dir = out_dir
        self.options = options
        self.window = window
        self.poll_interval_s = poll_interval_s
        self.max_task_retries = max_task_retries  # for the message of a range that failed for good

    def extract_rest(self, manifest: Manifest, records: HashedRecords, progress: EngineProgress) -> None:
        """Extract the input from `records` (positioned at `manifest.num_consumed`) to its end."""
        d = self.description
        prepared = prepare_prompts(records, d.tokenizer, d.vocab_size, d.length_policy)
        plans = (
            plan
            for plan in plan_shards(prepared, self.options.shard_tokens, manifest.num_consumed)
            if plan.prompts or plan.skipped
        )  # an empty last plan: the input ended right after a shard
        with ShardCommitter(self.out_dir, manifest) as committer:
            self._run(plans, records, committer, progress)
            committer.finish()

    def _run(
        self, plans: Iterator[ShardPlan], records: HashedRecords, committer: ShardCommitter, progress: EngineProgress
    ) -> None:
        import ray

        monitor = EngineMonitor(self.engines, progress, self.poll_interval_s)
        pending: deque[PendingRange] = deque()  # planned and not committed, in plan order
        running: dict[Any, tuple[int, PendingRange]] = {}  # RangeInfo ref -> (engine, range)
        idle = list(range(len(self.engines)))
        number, has_more, stop = 0, True, None
        while True:
            while idle and has_more and stop is None and len(pending) < self.window:
                plan = next(plans, None)
                if plan is None:
                    has_more = False
                    break
                stop = stop_error(plan, self.options.on_error)
                if stop is not None:
                    break  # commit what came before, as a single-process job does, then raise
                item = PendingRange(number, plan, records.commit(plan.end), is_done=not plan.prompts)
                if plan.prompts:
                    engine = idle.pop(0)
                    run_range = self.engines[engine].run_range.options(
                        num_returns=2, retry_exceptions=[TensorParallelError]
                    )
                    item.info_ref, item.rows_ref = run_range.remote(number, plan.prompts)
                    running[item.info_ref] = (engine, item)
                    progress.range_started(number)
                pending.append(item)
                number += 1
            while pending and pending[0].is_done:
                self._commit(pending.popleft(), committer, progress)
            if not running:
                if stop is not None:
                    raise stop
                if not has_more:
                    return
                continue
            monitor.poll([engine for engine, _ in running.values()])
            ready, _ = ray.wait([*running, *monitor.refs], num_returns=1, timeout=monitor.wait_timeout_s)
            monitor.take(ready)
            for ref in ready:
                if ref not in running:
                    continue  # a poll's answer, counted above
                engine, item = running.pop(ref)
                info = self._range_info(ref, engine, item.number)
                idle.append(engine)
                item.is_done = True
                progress.range_done(
                    engine, item.number, len(item.plan.prompts), item.plan.num_tokens, info.pid, info.elapsed_s
                )

    def _range_info(self, ref: Any, engine: int, number: int) -> Any:
        """The finished range's RangeInfo; raises the range's failure once Ray's retries are spent."""
        import ray

        try:
            return ray.get(ref)
        except TensorParallelError as error:  # Ray's RayTaskError(TensorParallelError): name where it happened
            cause = getattr(error, "cause", error)
            raise TensorParallelError(
                f"engine {engine} failed range {number} after {self.max_task_retries} retries on new "
                f"tensor-parallel groups: {cause}"
            ) from error

    def _commit(self, item: PendingRange, committer: ShardCommitter, progress: EngineProgress) -> None:
        import ray

        buffer = ray.get(item.rows_ref) if item.rows_ref is not None else None
        skipped = [skip.to_json() for skip in item.plan.skipped]
        committer.submit(ShardCommit(buffer, skipped, item.plan.end, item.input_sha256))
        progress.update(0, 0, len(item.plan.skipped))
