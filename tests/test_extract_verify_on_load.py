"""`load_activations` checks each shard's sha256 the first time it maps it; `verify=False` opts out.

Folders are written with fake activations (`test_extract_storage._write_folder`), then one shard's
bytes are changed in place, keeping its size: only the sha256 can tell.
"""

import pytest
import torch

from nnrun.extract import store as store_module
from nnrun.extract.store import load_activations
from nnrun.extract.verify import DamagedFolderError
from test_extract_storage import _fake_rows, _write_folder

LENGTHS = [3, 2, 4, 1]  # two prompts per shard: shards 0 and 1


def _flip_a_byte(path) -> None:
    """Change one byte near the end of the file (activation rows), keeping its size."""
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_shard_is_refused_on_first_read_and_intact_ones_are_served(tmp_path):
    manifest = _write_folder(tmp_path, LENGTHS)
    _flip_a_byte(tmp_path / manifest.shards[1].file)

    store = load_activations(tmp_path)  # opening reads only the manifest
    torch.testing.assert_close(store[0]["a"], _fake_rows(0, 3, "a"), rtol=0, atol=0)  # shard 0 is intact
    with pytest.raises(DamagedFolderError, match=rf"{manifest.shards[1].file}: has sha256 .* changed after"):
        store[2]["a"]
    with pytest.raises(DamagedFolderError, match=manifest.shards[1].file):
        list(store.tokens("a"))  # the flat stream checks each shard as it reaches it

    unchecked = load_activations(tmp_path, verify=False)
    served = [unchecked[i][module] for i in (2, 3) for module in ("a", "b.input")]
    served += [unchecked[i].token_ids for i in (2, 3)]
    expected = [_fake_rows(i, LENGTHS[i], module) for i in (2, 3) for module in ("a", "b.input")]
    expected += [torch.arange(i, i + LENGTHS[i], dtype=torch.int32) for i in (2, 3)]
    assert [got.shape for got in served] == [want.shape for want in expected]
    assert not all(torch.equal(got, want) for got, want in zip(served, expected))  # served as it is: the opt-out

    with pytest.raises(DamagedFolderError, match=manifest.shards[1].file):
        load_activations(tmp_path, verify=True)  # the whole folder, at once


def test_each_shard_is_hashed_once_per_store(tmp_path, monkeypatch):
    _write_folder(tmp_path, LENGTHS)
    hashed = []
    real = store_module.file_sha256
    monkeypatch.setattr(store_module, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    store = load_activations(tmp_path)
    for _ in range(3):
        for prompt in store:
            prompt["a"], prompt["b.input"], prompt.token_ids
    rows = torch.cat(list(store.tokens("a", batch_size=4)))
    assert sorted(hashed) == sorted(shard.file for shard in store.manifest.shards)
    assert rows.shape[0] == sum(LENGTHS)


def test_verify_takes_true_false_or_on_read(tmp_path):
    _write_folder(tmp_path, LENGTHS)
    with pytest.raises(ValueError, match="verify must be True, False or 'on_read'"):
        load_activations(tmp_path, verify="yes")


def test_token_dataset_checks_each_shard_it_opens(tmp_path):
    from nnrun.distributed import TokenDataset

    manifest = _write_folder(tmp_path, LENGTHS)
    _flip_a_byte(tmp_path / manifest.shards[1].file)
    dataset = TokenDataset(tmp_path, "a", batch_size=2, shuffle=False)
    with pytest.raises(DamagedFolderError, match=manifest.shards[1].file):
        list(dataset)
    unchecked = TokenDataset(load_activations(tmp_path, verify=False), "a", batch_size=2, shuffle=False)
    assert sum(batch.shape[0] for batch in unchecked) == sum(LENGTHS)  # served as it is: the opt-out
