"""TokenDataset: every row exactly once per epoch over ranks and DataLoader workers, a fixed order per seed, resume."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from ray_helpers import MODEL, job_prompts
from torch.utils.data import DataLoader

from nnrun.distributed.token_dataset import TokenDataset
from nnrun.extract import extract, load_activations

MODULE = "model.layers.1"
SMALL = {"block_rows": 40, "window_rows": 160}  # many windows from a small folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream")
    extract(MODEL, job_prompts(60, seed=1), [MODULE], out, shard_tokens=150, progress=False)
    store = load_activations(out)
    assert store.num_shards >= 6
    return out


def _all_rows(folder) -> torch.Tensor:
    store = load_activations(folder)
    return torch.cat([store[i][MODULE] for i in range(len(store))])  # [num_tokens, H]


def _counts(rows: torch.Tensor) -> Counter:
    return Counter(row.numpy().tobytes() for row in rows)


def _rank_rows(folder, rank: int, world_size: int, num_workers: int, **kwargs) -> list[torch.Tensor]:
    dataset = TokenDataset(folder, MODULE, batch_size=32, seed=7, rank=rank, world_size=world_size, **SMALL, **kwargs)
    return list(DataLoader(dataset, batch_size=None, num_workers=num_workers))


def test_every_row_once_per_epoch_over_ranks_and_workers(folder):
    expected = _all_rows(folder)
    batches = [b for rank in range(2) for b in _rank_rows(folder, rank, 2, num_workers=2)]
    got = torch.cat(batches)
    assert got.shape == expected.shape
    assert _counts(got) == _counts(expected)
    assert sum(b.shape[0] != 32 for b in batches) <= 4  # full batches, bar each consumer's last
    assert not torch.equal(got, expected)  # shuffled


def test_same_order_for_the_same_seed_and_epoch(folder):
    first = torch.cat(_rank_rows(folder, 0, 1, num_workers=2))
    again = torch.cat(_rank_rows(folder, 0, 1, num_workers=2))
    next_epoch = torch.cat(_rank_rows(folder, 0, 1, num_workers=2, epoch=1))
    assert torch.equal(first, again)
    assert not torch.equal(first, next_epoch) and _counts(first) == _counts(next_epoch)


@pytest.mark.parametrize("num_taken", [4, 5, 20])  # after whole rounds, mid-round, past a worker's end
def test_resume_from_a_row_offset(folder, num_taken):
    full = _rank_rows(folder, 0, 1, num_workers=2)
    start = sum(b.shape[0] for b in full[:num_taken])
    rest = _rank_rows(folder, 0, 1, num_workers=2, start=start)
    assert torch.equal(torch.cat(rest), torch.cat(full[num_taken:]))
    with pytest.raises(ValueError, match="not a whole number"):
        list(TokenDataset(folder, MODULE, batch_size=32, start=33))


def test_without_workers_or_shuffling(folder):
    dataset = TokenDataset(folder, MODULE, batch_size=100, shuffle=False)
    assert torch.equal(torch.cat(list(dataset)), _all_rows(folder))
    with pytest.raises(ValueError, match="rank must lie"):
        TokenDataset(folder, MODULE, batch_size=8, rank=2, world_size=2)
