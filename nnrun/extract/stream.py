"""A flat stream of activation rows across shard files, for a torch DataLoader (e.g. SAE training)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from torch.utils.data import IterableDataset, get_worker_info


class TokenActivationStream(IterableDataset):
    """Rows `[*shape]` (or batches `[batch_size, *shape]`) of one module, shard after shard.

    Shuffling permutes the shard order and the rows within each shard, so memory holds one
    shard's rows of one module at a time however large the store is. With DataLoader workers,
    each worker reads a disjoint set of shards; all workers draw the same shard order from
    `seed + epoch`. Call `set_epoch` between epochs for a new order.
    """

    def __init__(
        self,
        files: list[str],
        key: str,
        *,
        shuffle: bool = False,
        seed: int = 0,
        batch_size: int | None = None,
        check_shard: Callable[[int], None] | None = None,
    ) -> None:
        if batch_size is not None and batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.files = list(files)
        self.key = key
        self.shuffle = shuffle
        self.seed = seed
        self.batch_size = batch_size
        self.check_shard = check_shard  # called with a shard's index before it is read (the store's sha256 check)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        rows = self._rows()
        if self.batch_size is None:
            for block in rows:
                yield from block
        else:
            yield from rebatch(rows, self.batch_size)

    def _rows(self) -> Iterator[torch.Tensor]:
        """Each assigned shard's rows `[R, *shape]`, permuted when shuffling."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = (
            torch.randperm(len(self.files), generator=generator).tolist() if self.shuffle else range(len(self.files))
        )
        worker = get_worker_info()
        mine = list(order)[worker.id :: worker.num_workers] if worker is not None else list(order)
        for shard in mine:
            if self.check_shard is not None:
                self.check_shard(shard)
            with safe_open(self.files[shard], framework="pt") as f:
                rows = f.get_tensor(self.key)  # [R, *shape]
            if self.shuffle:
                shard_generator = torch.Generator().manual_seed((self.seed + self.epoch) * 1_000_003 + shard)
                rows = rows[torch.randperm(rows.shape[0], generator=shard_generator)]
            yield rows


def rebatch(blocks: Iterator[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """Full batches across block boundaries; only the last may be shorter."""
    carry: list[torch.Tensor] = []
    num_carried = 0
    for block in blocks:
        carry.append(block)
        num_carried += block.shape[0]
        if num_carried < batch_size:
            continue
        merged = torch.cat(carry)  # [num_carried, *shape]
        num_full = num_carried // batch_size * batch_size
        yield from merged[:num_full].split(batch_size)
        carry, num_carried = [merged[num_full:]], num_carried - num_full
    if num_carried:
        yield torch.cat(carry)
