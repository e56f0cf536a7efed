"""Who runs an extraction job: this process, or engines elsewhere, behind one small interface.

`extract()` turns its arguments into an `ExtractionRequest` and hands it to an executor:
`LocalExecutor` (one engine in this process) or `nnrun.distributed.RayExecutor` (engine actors
on a Ray cluster). Every executor plans the same shards and writes the same folder bytes.
The distributed package is imported only when a job asks for it (Ray is an optional install).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from nnrun.extract.inputs import PromptSource, open_prompts
from nnrun.extract.job import DEFAULT_SHARD_TOKENS, ExtractionJob, ExtractionOptions, as_llm
from nnrun.extract.progress import ExtractionSummary
from nnrun.model_source import as_model_source, engine_of


@dataclass(frozen=True)
class ExtractionRequest:
    """One extraction job, as every executor receives it."""

    model: Any  # an nnrun.LLM (local only) or anything nnrun.LLM accepts
    tokenizer: Any
    llm_kwargs: dict[str, Any] | None
    source: PromptSource
    modules: list[str] | str
    out_dir: Path
    options: ExtractionOptions


class ExtractionExecutor(Protocol):
    """Runs an `ExtractionRequest` to its folder and says what it wrote."""

    def run(self, request: ExtractionRequest) -> ExtractionSummary: ...


class LocalExecutor:
    """The job on one engine in this process (built from the request's model unless it is one already)."""

    def run(self, request: ExtractionRequest) -> ExtractionSummary:
        llm, is_owned = as_llm(request.model, request.tokenizer, request.llm_kwargs, request.options.progress)
        try:
            return ExtractionJob(llm, request.source, request.modules, request.out_dir, request.options).run()
        finally:
            if is_owned:
                llm.shutdown()


def as_executor(executor: Any, num_engines: int | None, ray_address: str | None, verbose: bool) -> ExtractionExecutor:
    """The executor `extract`'s `executor=` names: "local", "ray", a RayExecutor, or any object with `run`."""
    if isinstance(executor, str) and executor == "local":
        if num_engines is not None or ray_address is not None or verbose:
            raise ValueError("num_engines, ray_address and verbose apply to executor='ray'")
        return LocalExecutor()
    if not isinstance(executor, str) and callable(getattr(executor, "run", None)):
        if num_engines is not None or ray_address is not None or verbose:
            raise ValueError(f"num_engines, ray_address and verbose do not apply to {type(executor).__name__}")
        return executor
    from nnrun.distributed.executor import ray_runner  # "ray" or a RayExecutor; Ray is imported once a job runs

    return ray_runner(executor, num_engines, ray_address, verbose)


def extract(
    model: Any,
    prompts: Any,
    modules: list[str] | str,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    positions: str = "all",
    dtype: str | torch.dtype | None = None,
    max_length: int | None = None,
    truncate: bool = False,
    on_error: str = "stop",
    text_field: str | None = None,
    limit: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    resume: bool = True,
    progress: bool = True,
    llm_kwargs: dict[str, Any] | None = None,
    executor: Any = "local",
    num_engines: int | None = None,
    ray_address: str | None = None,
    verbose: bool = False,
) -> ExtractionSummary:
    """Extract `modules`' values for every prompt into shards under `out_dir`; see `load_activations`.

    `model`: an `nnrun.LLM` or an nnrun `LanguageModel`/`VLLM` (its engine runs the job), or anything
    `nnrun.LLM` accepts (built with `tokenizer` and `llm_kwargs`, e.g. device, dtype,
    max_num_batched_tokens, and shut down at the end).
    `prompts`: an iterable of strings or token id lists, or the path of a .txt / .jsonl /
    .parquet file or a saved HF dataset folder; a record's prompt is its `text_field` (default: its
    "prompt" field, else "text", else its only string field).
    `modules`: HF module paths, optionally ending in ".input" or ".output" (the default).
    `executor="ray"` (or an `nnrun.distributed.RayExecutor` for more options, or any object with
    `run(request) -> ExtractionSummary`, see `ExtractionExecutor`): spread the shards
    over `num_engines` engine actors on the Ray cluster at `ray_address` (default: the connected
    one, else $RAY_ADDRESS, else a new local one), `verbose` adds a progress line per engine; the
    folder is byte-identical to the one a single process writes.
    """
    engine = engine_of(model)  # an nnrun.LanguageModel/VLLM: extract on its engine
    if engine is None:
        as_model_source(model)  # anything the engine cannot load is refused in one line, before any file opens
    model = model if engine is None else engine
    options = ExtractionOptions(positions, dtype, max_length, truncate, on_error, shard_tokens, resume, progress)
    source = open_prompts(prompts, text_field=text_field, limit=limit)
    runner = as_executor(executor, num_engines, ray_address, verbose)
    return runner.run(ExtractionRequest(model, tokenizer, llm_kwargs, source, modules, Path(out_dir), options))
