"""A shuffled, resumable stream of one module's rows for SAE training: every row once per epoch, over ranks and workers.

An epoch's order is a pure function of (seed, epoch) and the folder's manifest, computed without
reading any activations:
- each shard's rows are cut into *blocks* of `block_rows` consecutive rows;
- the blocks are permuted, and consecutive permuted blocks form *windows* of about `window_rows`
  rows (so a window mixes blocks from many shards: many prompts, many parts of the input);
- the windows are dealt round-robin to the *consumers*: rank r's DataLoader worker w is consumer
  `r * num_workers + w`. Each consumer reads its windows one at a time (one window in memory),
  permutes each window's rows, and cuts its rows into batches of `batch_size` (only its last
  batch may be shorter).
So every row goes to exactly one consumer once per epoch, and no consumer reads another's rows.
A DataLoader takes its workers' batches round-robin, so what a rank sees is fixed by (seed, epoch,
world_size, num_workers, batch_size), and a rank resumes from the number of rows it had taken
(`start`): each worker works out how many of its batches that was and skips them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch.utils.data import IterableDataset, get_worker_info

from nnrun.extract.shards import activation_key
from nnrun.extract.store import ActivationStore, check_shard_file, load_activations
from nnrun.extract.stream import rebatch


@dataclass(frozen=True)
class Block:
    """Rows [start, stop) of one shard."""

    shard: int
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


class TokenDataset(IterableDataset):
    """Batches `[batch_size, *shape]` of one module's rows, shuffled per (seed, epoch), split by rank and worker.

    Use with `DataLoader(dataset, batch_size=None, num_workers=W)`; call `set_epoch` before each
    epoch (the workers get the dataset as it is when an epoch's iteration starts).
    """

    def __init__(
        self,
        store: ActivationStore | str | Path,
        module: str,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        block_rows: int = 1024,
        window_rows: int = 32768,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        start: int = 0,
    ) -> None:
        store = store if isinstance(store, ActivationStore) else load_activations(store)
        if module not in store.modules:
            raise KeyError(f"module {module!r} was not extracted; the store holds {store.modules}")
        for name, value in (("batch_size", batch_size), ("block_rows", block_rows), ("window_rows", window_rows)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        rank, world_size = _rank_and_world_size(rank, world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        self.files = [str(store.out_dir / shard.file) for shard in store.manifest.shards]
        # Each process reading a shard checks its sha256 the first time it opens it, as the store does
        # (DataLoader workers are other processes: the store's own record of what it checked is not theirs).
        self.out_dir = store.out_dir
        self.shards_to_verify = list(store.manifest.shards) if store.verify_on_read else None
        self.rows_per_shard = [shard.num_rows for shard in store.manifest.shards]
        self.key = activation_key(module)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.block_rows = block_rows
        self.blocks_per_window = max(1, window_rows // block_rows)
        self.rank = rank
        self.world_size = world_size
        self.set_epoch(epoch, start)

    @property
    def num_rows(self) -> int:
        """Rows in an epoch, over all ranks."""
        return sum(self.rows_per_shard)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch `epoch`, from the `start`-th row this rank takes in it (a resume; 0: from its beginning)."""
        if epoch < 0 or start < 0:
            raise ValueError(f"epoch and start must be non-negative, got {epoch} and {start}")
        self.epoch = epoch
        self.start = start

    def windows(self) -> list[list[Block]]:
        """This epoch's windows, in the order they are dealt to consumers."""
        blocks = [
            Block(shard, first, min(first + self.block_rows, num_rows))
            for shard, num_rows in enumerate(self.rows_per_shard)
            for first in range(0, num_rows, self.block_rows)
        ]
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(blocks))
            blocks = [blocks[i] for i in order]
        step = self.blocks_per_window
        return [blocks[i : i + step] for i in range(0, len(blocks), step)]

    def __iter__(self) -> Iterator[torch.Tensor]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        windows = self.windows()
        num_consumers = self.world_size * num_workers
        first = self.rank * num_workers
        rows_per_worker = [
            sum(sum(b.num_rows for b in window) for window in windows[c::num_consumers])
            for c in range(first, first + num_workers)
        ]
        taken, next_worker = _batches_taken(self.start, rows_per_worker, self.batch_size)
        # The DataLoader asks worker 0 first: it plays the part of the worker that was due next.
        part = (worker_id + next_worker) % num_workers
        num_skipped = taken[part] * self.batch_size
        mine = [(index, windows[index]) for index in range(first + part, len(windows), num_consumers)]
        yield from rebatch(self._rows(mine, num_skipped), self.batch_size)

    def _rows(self, windows: list[tuple[int, list[Block]]], num_skipped: int) -> Iterator[torch.Tensor]:
        """Each window's rows `[R, *shape]`, permuted when shuffling, less the first `num_skipped` rows overall."""
        handles: dict[int, object] = {}
        for index, window in windows:
            num_rows = sum(block.num_rows for block in window)
            if num_skipped >= num_rows:
                num_skipped -= num_rows
                continue
            rows = torch.cat([self._read(handles, block) for block in window])  # [R, *shape]
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch, index]).permutation(num_rows)
                rows = rows[torch.from_numpy(order)]
            yield rows[num_skipped:]
            num_skipped = 0

    def _read(self, handles: dict[int, object], block: Block) -> torch.Tensor:
        handle = handles.get(block.shard)
        if handle is None:
            if self.shards_to_verify is not None:
                check_shard_file(self.out_dir, self.shards_to_verify[block.shard], block.shard)
            handle = handles[block.shard] = safe_open(self.files[block.shard], framework="pt")
        return handle.get_slice(self.key)[block.start : block.stop]  # [block rows, *shape]


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The given values, else torch.distributed's when it is initialized, else (0, 1)."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if rank is not None or world_size is not None:
        raise ValueError("pass both rank and world_size, or neither")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _batches_taken(start: int, rows_per_worker: list[int], batch_size: int) -> tuple[list[int], int]:
    """How many batches each worker had yielded once a DataLoader had taken `start` rows from them round-robin,
    and which worker was due next."""
    num_batches = [-(-rows // batch_size) for rows in rows_per_worker]
    taken = [0] * len(rows_per_worker)
    remaining, next_worker = start, 0
    while remaining > 0:
        active = [w for w in range(len(taken)) if taken[w] < num_batches[w]]
        if not active:
            raise ValueError(f"start={start} lies past the end of this rank's epoch ({sum(rows_per_worker)} rows)")
        for w in active:
            size = min(batch_size, rows_per_worker[w] - taken[w] * batch_size)
            if size > remaining:
                raise ValueError(
                    f"start={start} is not a whole number of this rank's batches (batch_size="
                    f"{batch_size}, {len(rows_per_worker)} workers)"
                )
            remaining -= size
            taken[w] += 1
            next_worker = (w + 1) % len(taken)
            if remaining == 0:
                break
    return taken, next_worker
