"""`nnrun.extract`: run prompts through the engine's prefill and store named modules' values in shards.

One job: open the folder (new or resumed), check what it holds and replay the input up to its
last intact shard (resume.py: or refuse another input, or extend a complete folder whose input
grew), then for each planned shard run its forward batches with hooks on the named modules, write
the shard, and commit it in the manifest. See plan.py for why a resume is byte-identical.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nnrun.config import resolve_dtype
from nnrun.extract.committer import ShardCommit, ShardCommitter
from nnrun.extract.defaults import DEFAULT_SHARD_TOKENS
from nnrun.extract.folder import claim_folder
from nnrun.extract.hooks import ActivationCapture, ModuleSpec, StopForward, gather_rows, packed_starts, resolve_modules
from nnrun.extract.identity import checkpoint_hash, config_hash, tokenizer_hash, weights_hash
from nnrun.extract.inputs import MISSING_FIELD, InputError, PromptSource
from nnrun.extract.manifest import Manifest
from nnrun.extract.plan import HashedRecords, ShardPlan, forward_batches, plan_shards
from nnrun.extract.prepare import LengthPolicy, PreparedPrompt, prepare_prompts
from nnrun.extract.progress import ExtractionSummary, Progress
from nnrun.extract.resume import continue_folder
from nnrun.extract.shards import ShardBuffer


@dataclass(frozen=True)
class ExtractionOptions:
    """How to extract; everything here but `on_error`, `resume` and `progress` is part of the folder's settings."""

    positions: str = "all"  # "all": every token; "last": each prompt's last token
    dtype: str | torch.dtype | None = None  # stored dtype; None or "auto": the model's dtype
    max_length: int | None = None  # longest prompt in tokens; None: the model's context length
    truncate: bool = False  # cut longer prompts to max_length instead of reporting them
    on_error: str = "stop"  # "stop" at the first bad item, or "skip" it and record it in the manifest
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # prompt tokens per shard file (a longer prompt gets its own)
    resume: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if self.positions not in ("all", "last"):
            raise ValueError(f"positions must be 'all' or 'last', got {self.positions!r}")
        if self.on_error not in ("stop", "skip"):
            raise ValueError(f"on_error must be 'stop' or 'skip', got {self.on_error!r}")
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}")
        if self.shard_tokens <= 0:
            raise ValueError(f"shard_tokens must be positive, got {self.shard_tokens}")
        if self.dtype is not None:
            resolve_dtype(self.dtype, "cpu")  # raises ValueError naming the allowed dtypes


def as_llm(model: Any, tokenizer: Any, llm_kwargs: dict[str, Any] | None, progress: bool) -> tuple[Any, bool]:
    """`model` itself when it is an `nnrun.LLM`, else one built from it; and whether the caller owns (shuts down) it."""
    from transformers.utils import logging as hf_logging

    from nnrun.engine import LLM

    if isinstance(model, LLM):
        if tokenizer is not None or llm_kwargs:
            raise ValueError(
                "tokenizer and llm_kwargs apply when extract builds the LLM; pass them to nnrun.LLM instead"
            )
        return model, False
    is_bar_enabled = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()  # quiet means quiet: no "Loading weights" bar either
    try:
        return LLM(model, tokenizer=tokenizer, **(llm_kwargs or {})), True
    finally:
        if is_bar_enabled:
            hf_logging.enable_progress_bar()


class ExtractionJob:
    """One call of `extract` on a built engine."""

    def __init__(
        self, llm: Any, source: PromptSource, modules: list[str] | str, out_dir: Path, options: ExtractionOptions
    ) -> None:
        self.llm = llm
        self.runner = llm.runner
        self.source = source
        self.out_dir = out_dir
        self.options = options
        self.specs: list[ModuleSpec] = resolve_modules(llm.model, modules)
        is_model_dtype = options.dtype is None or options.dtype == "auto"
        self.store_dtype = self.runner.dtype if is_model_dtype else resolve_dtype(options.dtype, "cpu")
        # A prompt must fit the context and the KV pool, and a forward batch the step budget.
        model_limit = min(self.runner.max_model_len, self.runner.max_total_tokens)
        user_limit = options.max_length if options.max_length is not None else model_limit
        self.length_policy = LengthPolicy(min(user_limit, model_limit), user_limit <= model_limit, options.truncate)
        self.batch_tokens = min(llm.config.scheduler.max_num_batched_tokens, self.runner.max_total_tokens)
        # The exact path runs one HF forward per prompt: a forward's values are one prompt's.
        self.batch_prompts = llm.config.scheduler.max_num_seqs if llm.runner.path.packs_requests else 1
        self.page_size = self.runner.allocator.page_size
        self.can_stop_early = False  # set once a complete forward shows the runner packs prompts in order

    def settings(self) -> dict[str, Any]:
        """Everything that shapes the stored bytes; a resume must match it exactly."""
        if self.runner.captures_on_ranks:  # the weights are on the ranks: the checkpoint they read identifies them
            weights_sha256, weights_mode = checkpoint_hash(self.runner.checkpoint)
        else:
            weights_sha256, weights_mode = weights_hash(self.llm.model)
        settings = {
            "model": {
                "config_sha256": config_hash(self.llm.model),
                "weights_sha256": weights_sha256,
                "weights_hash": weights_mode,
                "dtype": str(self.runner.dtype).removeprefix("torch."),
            },
            "tokenizer_sha256": tokenizer_hash(self.llm.tokenizer),
            "modules": [spec.name for spec in self.specs],
            "positions": self.options.positions,
            "dtype": str(self.store_dtype).removeprefix("torch."),
            "max_length": self.options.max_length,
            "truncate": self.options.truncate,
            "shard_tokens": self.options.shard_tokens,
            "batch_tokens": self.batch_tokens,  # forward batching changes float rounding, so it is a setting
            "batch_prompts": self.batch_prompts,
            "page_size": self.page_size,
            "text_field": self.source.text_field,
            "limit": self.source.limit,
        }
        tp_size = self.llm.config.parallel.tensor_parallel_size
        if tp_size > 1:  # ranks sum each row-parallel projection in pieces: other float rounding than one device
            settings["tensor_parallel_size"] = tp_size
        return json.loads(json.dumps(settings))  # exactly what a reloaded manifest compares against

    def model_info(self) -> dict[str, Any]:
        name = getattr(self.runner, "model_name", None) or type(self.llm.model).__name__
        return {"name": str(name), "class": type(self.llm.model).__name__, "device": str(self.runner.device)}

    def run(self) -> ExtractionSummary:
        return run_in_folder(self.out_dir, self.settings(), self.model_info(), self.source, self.options, self._extract)

    def _extract(self, manifest: Manifest, records: HashedRecords, progress: Progress) -> None:
        """Extract the input from `records` (positioned at `manifest.num_consumed`) to its end."""
        prepared = prepare_prompts(records, self.llm.tokenizer, self.llm.vocab_size, self.length_policy)
        with ShardCommitter(self.out_dir, manifest) as committer:
            for plan in plan_shards(prepared, self.options.shard_tokens, manifest.num_consumed):
                if not plan.prompts and not plan.skipped:
                    continue  # the input ended right after the last shard
                self._check_skipped(plan)
                buffer = self.run_shard(plan, progress) if plan.prompts else None
                progress.update(0, 0, len(plan.skipped))
                skipped = [item.to_json() for item in plan.skipped]
                committer.submit(ShardCommit(buffer, skipped, plan.end, records.commit(plan.end)))
            committer.finish()

    def _check_skipped(self, plan: ShardPlan) -> None:
        error = stop_error(plan, self.options.on_error)
        if error is not None:
            raise error

    def run_shard(self, plan: ShardPlan, progress: Progress) -> ShardBuffer:
        """Forward every batch of the shard.

        The rows stay on the model's device until the committer thread copies them out, so a GPU
        never waits on a device-to-host copy; up to three shards' rows (one being filled, one
        queued, one being written) are on the device at once: size `shard_tokens` for that.
        """
        buffer = ShardBuffer([spec.name for spec in self.specs])
        for batch in forward_batches(plan.prompts, self.batch_tokens, self.batch_prompts, self.page_size):
            rows = self._forward(batch)
            rows_per_prompt = [p.num_tokens if self.options.positions == "all" else 1 for p in batch]
            buffer.add([p.index for p in batch], [p.token_ids for p in batch], rows, rows_per_prompt)
            progress.update(len(batch), sum(p.num_tokens for p in batch))
        return buffer

    def _forward(self, batch: list[PreparedPrompt]) -> dict[str, torch.Tensor]:
        """One packed prefill; each module's rows for the batch's prompts, back to back."""
        lengths = [p.num_tokens for p in batch]
        if self.runner.captures_on_ranks:  # tensor-parallel: the hooks run on rank 0's modules
            forward_batch, flat = self.runner.run_prefill_capturing(
                [p.token_ids for p in batch], self.specs, self.store_dtype
            )
            starts, seq_lens = list(forward_batch.extend_start_loc), list(forward_batch.extend_seq_lens)
            flat = {name: value.to(self.runner.device) for name, value in flat.items()}
            return {name: gather_rows(value, starts, lengths, self.options.positions) for name, value in flat.items()}
        with ActivationCapture(self.llm.model, self.specs, self.store_dtype, self.can_stop_early) as capture:
            try:
                forward_batch = self.runner.run_prefill_only([p.token_ids for p in batch])
                starts, seq_lens = list(forward_batch.extend_start_loc), list(forward_batch.extend_seq_lens)
            except StopForward:
                # No ForwardBatch comes back from a stopped forward; the layout is the packed one,
                # as the job's first (complete) forward showed.
                starts, seq_lens = packed_starts(lengths), lengths
            flat = capture.take(sum(seq_lens))  # module -> [N, ...]
        if seq_lens != lengths:
            raise RuntimeError(f"the runner packed {seq_lens} tokens for prompts of {lengths}")
        if starts == packed_starts(lengths):
            self.can_stop_early = True
        return {name: gather_rows(value, starts, lengths, self.options.positions) for name, value in flat.items()}


def stop_error(plan: ShardPlan, on_error: str) -> InputError | None:
    """The error that ends the job at this plan's first bad item under on_error="stop"; None to go on."""
    if not plan.skipped or on_error != "stop":
        return None
    if plan.skipped[0].reason.startswith(MISSING_FIELD):  # the reason names the fix; skipping would skip them all
        return InputError(f"{plan.skipped[0].message()}. Stopped before writing anything after the last complete shard")
    return InputError(
        f"{plan.skipped[0].message()}. Stopped before writing anything after the last complete shard; "
        "fix the input, or pass on_error='skip' (CLI: --on-error skip) to leave such items out"
    )


ExtractRest = Callable[[Manifest, HashedRecords, Progress], None]


def run_in_folder(
    out_dir: Path,
    settings: dict[str, Any],
    model_info: dict[str, Any],
    source: PromptSource,
    options: ExtractionOptions,
    extract_rest: ExtractRest,
    make_progress: Callable[..., Progress] = Progress,
) -> ExtractionSummary:
    """Open the folder (new or resumed), let `extract_rest` extract the input from where it stands, summarize.

    The seam between a job and where its forwards run: this process (ExtractionJob) or many
    engines (nnrun.distributed); both commit shards through a ShardCommitter in input order.
    """
    with claim_folder(out_dir, settings, model_info, options.resume) as manifest:
        records = continue_folder(out_dir, manifest, source)
        num_resumed = len(manifest.shards)
        progress = make_progress(options.progress, source.total, initial=manifest.num_consumed)
        summary = None
        try:
            if records is not None:
                extract_rest(manifest, records, progress)
            summary = ExtractionSummary(
                out_dir=str(out_dir),
                num_prompts=manifest.num_prompts,
                num_tokens=manifest.num_tokens,
                num_skipped=len(manifest.skipped),
                num_shards=len(manifest.shards),
                num_resumed_shards=num_resumed,
                num_new_prompts=progress.num_prompts,
                num_new_tokens=progress.num_tokens,
                elapsed_s=progress.elapsed_s,
                is_complete=manifest.is_complete,
            )
        finally:
            progress.close(summary)
    return summary
