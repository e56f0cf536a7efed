"""Write shards and commit them to the manifest on a background thread, so the forwards never wait on disk.

The job thread hands over one finished shard at a time; the committer thread writes it (device
to host copy, safetensors file, rename) and then updates the manifest, strictly in submission
order. It alone touches the manifest while the job runs. After a failure it commits nothing
more, so the manifest always ends at the last shard that was written whole.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nnrun.extract.manifest import Manifest
from nnrun.extract.shards import ShardBuffer, ShardWriteError, write_shard

_STOP = object()


@dataclass
class ShardCommit:
    """One step of the manifest: a shard (or none, when a stretch of input held only skipped items)."""

    buffer: ShardBuffer | None
    skipped: list[dict[str, Any]] = field(default_factory=list)
    end: int = 0  # input records consumed once committed
    input_sha256: str = ""

    def __post_init__(self) -> None:
        if self.end < 0:
            raise ValueError(f"ShardCommit.end must be non-negative, got {self.end}")


class ShardCommitter:
    """A background thread applying ShardCommits to the folder; at most `max_pending` wait in line.

    Use as a context manager: leaving the block waits for the queued commits (even when the
    block raised, so finished shards are kept), and re-raises a write failure.
    """

    def __init__(self, out_dir: Path, manifest: Manifest, max_pending: int = 1) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        self.out_dir = out_dir
        self.manifest = manifest
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="nnrun-extract-writer", daemon=True)

    def __enter__(self) -> "ShardCommitter":
        self._thread.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        self._drain()
        if exc is None and self.error is not None:
            raise self.error

    def submit(self, commit: ShardCommit) -> None:
        """Queue a commit (blocks while the queue is full); raises an earlier commit's failure."""
        if self.error is not None:
            raise self.error
        self._queue.put(commit)

    def finish(self) -> None:
        """Wait for every queued commit, then mark the folder complete."""
        self._drain()
        if self.error is not None:
            raise self.error
        self.manifest.is_complete = True
        self._save()

    def _drain(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while (commit := self._queue.get()) is not _STOP:
            if self.error is not None:
                continue  # after a failure nothing more is committed
            try:
                self._apply(commit)
            except BaseException as error:  # handed to the job thread, which raises it
                self.error = error

    def _apply(self, commit: ShardCommit) -> None:
        manifest = self.manifest
        if commit.buffer is not None:
            shard, buffer = len(manifest.shards), commit.buffer
            info = write_shard(self.out_dir, shard, buffer)
            offset = token_offset = 0
            for index, num_tokens, num_rows in zip(
                buffer.prompt_index, buffer.prompt_num_tokens, buffer.num_rows_per_prompt
            ):
                manifest.add_prompt(index, num_tokens, shard, offset, token_offset)
                offset += num_rows
                token_offset += num_tokens
            manifest.shards.append(info)
            if not manifest.activation_shapes:
                manifest.activation_shapes = buffer.row_shapes()
        manifest.skipped.extend(commit.skipped)
        manifest.num_consumed = commit.end
        manifest.input_sha256 = commit.input_sha256
        self._save()

    def _save(self) -> None:
        try:
            self.manifest.save(self.out_dir)
        except OSError as error:
            raise ShardWriteError(
                error.errno,
                f"could not update {self.out_dir / 'manifest.json'} ({error.strerror or error}); "
                "the shards it lists are complete: fix the cause and re-run the same command to resume",
            ) from error
