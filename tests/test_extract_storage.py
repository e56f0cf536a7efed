"""Shards, manifest, reader store and layout planning of extraction, with fake activations (no engine)."""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from torch.utils.data import DataLoader

from nnrun.extract.folder import open_folder
from nnrun.extract.inputs import open_prompts
from nnrun.extract.manifest import Manifest, SettingsMismatchError, ShardInfo, settings_diff, write_atomic
from nnrun.extract.plan import HashedRecords, ShardPlan, forward_batches, plan_shards
from nnrun.extract.prepare import PreparedPrompt, SkippedPrompt
from nnrun.extract.shards import ShardBuffer, write_safetensors, write_shard
from nnrun.extract.store import load_activations

H = 8
SETTINGS = {"modules": ["a", "b.input"], "positions": "all", "dtype": "float32", "shard_tokens": 10}


def _fake_rows(index: int, num_tokens: int, module: str) -> torch.Tensor:
    """[num_tokens, H] values that name their prompt, token and module."""
    base = torch.arange(num_tokens, dtype=torch.float32)[:, None] * 10 + index * 1000
    return base + torch.arange(H) / 100 + (0.5 if module == "b.input" else 0.0)


def _write_folder(folder, lengths: list[int], positions: str = "all", per_shard: int = 2) -> Manifest:
    """A folder as a job would leave it: shards of `per_shard` prompts each, committed in the manifest."""
    manifest = open_folder(folder, {**SETTINGS, "positions": positions}, {"name": "fake"}, resume=True)
    index = 0
    for shard in range(0, len(lengths), per_shard):
        buffer = ShardBuffer(SETTINGS["modules"])
        group = lengths[shard : shard + per_shard]
        indices = list(range(index, index + len(group)))
        tokens = [list(range(i, i + n)) for i, n in zip(indices, group)]
        rows = {m: torch.cat([_fake_rows(i, n, m) for i, n in zip(indices, group)]) for m in SETTINGS["modules"]}
        per_prompt = group
        if positions == "last":
            ends = torch.tensor(group).cumsum(0) - 1
            rows = {m: r[ends] for m, r in rows.items()}
            per_prompt = [1] * len(group)
        buffer.add(indices, tokens, rows, per_prompt)
        info = write_shard(folder, len(manifest.shards), buffer)
        offset = token_offset = 0
        for i, n, r in zip(indices, group, per_prompt):
            manifest.add_prompt(i, n, len(manifest.shards), offset, token_offset)
            offset, token_offset = offset + r, token_offset + n
        manifest.shards.append(info)
        manifest.activation_shapes = buffer.row_shapes()
        index += len(group)
    manifest.num_consumed = index
    manifest.is_complete = True
    manifest.save(folder)
    return manifest


def test_safetensors_writer_is_deterministic_and_readable(tmp_path):
    tensors = {
        "z": torch.randn(3, 4),
        "a": torch.arange(5, dtype=torch.int32),
        "h": torch.randn(2, 2).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }
    size, digest = write_safetensors(tmp_path / "x.safetensors", dict(reversed(list(tensors.items()))))
    write_safetensors(tmp_path / "y.safetensors", tensors)
    data_x, data_y = (tmp_path / "x.safetensors").read_bytes(), (tmp_path / "y.safetensors").read_bytes()
    assert data_x == data_y and size == len(data_x) and digest == hashlib.sha256(data_x).hexdigest()
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor)


def test_manifest_round_trip_and_deterministic_text(tmp_path):
    manifest = Manifest(settings={"b": 1, "a": {"y": [1, 2], "x": None}}, model={"name": "m"})
    manifest.add_prompt(3, 7, 0, 0, 0)
    manifest.shards.append(ShardInfo("shard-00000.safetensors", 1, 7, 7, 100, "ab"))
    manifest.skipped.append({"index": 2, "line": 3, "reason": "empty prompt"})
    manifest.save(tmp_path)
    loaded = Manifest.load(tmp_path)
    assert loaded == manifest
    assert loaded.to_text() == (tmp_path / "manifest.json").read_text()
    assert json.loads(loaded.to_text())["format"] == "nnrun-activations/1"
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="not an nnrun activation manifest"):
        Manifest.from_text('{"format": "other"}')
    with pytest.raises(ValueError, match="columns"):
        Manifest(settings={}, model={}, prompts={"index": []})


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    write_atomic(path, b"old")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", fail)
    with pytest.raises(OSError):
        write_atomic(path, b"new")
    assert path.read_bytes() == b"old" and not list(tmp_path.glob("*.tmp"))


def test_settings_diff_names_each_difference():
    assert settings_diff({"a": 1, "m": {"x": 1, "y": 2}}, {"a": 2, "m": {"x": 1, "y": 3}}) == [
        "a: stored 1, now 2",
        "m.y: stored 2, now 3",
    ]


def test_folder_refuses_other_settings_foreign_files_and_no_resume(tmp_path):
    open_folder(tmp_path / "out", SETTINGS, {}, resume=True)
    with pytest.raises(SettingsMismatchError, match="positions: stored 'all', now 'last'"):
        open_folder(tmp_path / "out", {**SETTINGS, "positions": "last"}, {}, resume=True)
    with pytest.raises(FileExistsError):
        open_folder(tmp_path / "out", SETTINGS, {}, resume=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        open_folder(tmp_path / "other", SETTINGS, {}, resume=True)


def test_folder_removes_uncommitted_shards_and_temp_files(tmp_path):
    _write_folder(tmp_path, [3, 4, 5], per_shard=2)
    manifest = Manifest.load(tmp_path)
    manifest.shards.pop()  # as if killed after renaming the last shard, before the manifest update
    manifest.save(tmp_path)
    (tmp_path / "shard-00002.safetensors.tmp").write_bytes(b"partial")
    open_folder(tmp_path, SETTINGS, {}, resume=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard-00000.safetensors"]


def test_store_reads_prompts_tokens_and_modules(tmp_path):
    lengths = [3, 5, 1, 4, 2]
    _write_folder(tmp_path, lengths)
    store = load_activations(tmp_path)
    assert len(store) == 5 and store.num_tokens == 15 and store.num_shards == 3 and store.is_complete
    for i, n in enumerate(lengths):
        for module in ("a", "b.input"):
            assert torch.equal(store[i][module], _fake_rows(i, n, module))
        assert store[i].token_ids.tolist() == list(range(i, i + n))
        assert store[i].input_index == i and store[i].num_tokens == n
    assert list(store[-1]) == ["a", "b.input"]
    assert store.dtype == torch.float32
    with pytest.raises(IndexError):
        store[5]
    with pytest.raises(KeyError, match="was not extracted"):
        store[0]["c"]


def test_store_last_positions_give_one_row(tmp_path):
    lengths = [3, 5, 1]
    _write_folder(tmp_path, lengths, positions="last")
    store = load_activations(tmp_path)
    for i, n in enumerate(lengths):
        assert torch.equal(store[i]["a"], _fake_rows(i, n, "a")[-1:])
        assert store[i].token_ids.shape == (n,)


def test_token_stream_in_order_shuffled_batched_and_with_workers(tmp_path):
    lengths = [3, 5, 1, 4, 2, 6, 2]
    _write_folder(tmp_path, lengths, per_shard=2)
    store = load_activations(tmp_path)
    expected = torch.cat([_fake_rows(i, n, "a") for i, n in enumerate(lengths)])  # [23, H]
    rows = torch.stack(list(store.tokens("a")))
    assert torch.equal(rows, expected)
    shuffled = torch.stack(list(store.tokens("a", shuffle=True, seed=1)))
    assert not torch.equal(shuffled, expected)
    assert torch.equal(shuffled[shuffled[:, 0].argsort()], expected[expected[:, 0].argsort()])
    assert torch.equal(torch.stack(list(store.tokens("a", shuffle=True, seed=1))), shuffled)  # seeded
    batches = list(store.tokens("a", batch_size=5))
    assert [b.shape[0] for b in batches] == [5, 5, 5, 5, 3] and torch.equal(torch.cat(batches), expected)
    loader = DataLoader(store.tokens("a", shuffle=True, batch_size=4), batch_size=None, num_workers=2)
    loaded = torch.cat(list(loader))
    assert torch.equal(loaded[loaded[:, 0].argsort()], expected[expected[:, 0].argsort()])


def test_plan_shards_is_a_function_of_the_records():
    items = [
        PreparedPrompt(0, [1] * 4),
        SkippedPrompt(1, "item 1", "empty prompt"),
        PreparedPrompt(2, [1] * 5),
        PreparedPrompt(3, [1] * 12),
        PreparedPrompt(4, [1] * 3),
        SkippedPrompt(5, "item 5", "bad"),
    ]
    plans = list(plan_shards(items, shard_tokens=10, start=0))
    assert [([p.index for p in s.prompts], [k.index for k in s.skipped], s.end) for s in plans] == [
        ([0, 2], [1], 3),
        ([3], [], 4),
        ([4], [5], 6),
    ]
    # A resume starts at a shard's end and makes the same shards from there.
    resumed = list(plan_shards(items[3:], shard_tokens=10, start=3))
    assert [(s.prompts, s.skipped, s.end) for s in resumed] == [(s.prompts, s.skipped, s.end) for s in plans[1:]]
    assert [s.end for s in plan_shards([], 10, start=7)] == [7]
    assert ShardPlan(prompts=items[:1]).num_tokens == 4


def test_forward_batches_respect_token_and_prompt_budgets():
    prompts = [PreparedPrompt(i, [1] * n) for i, n in enumerate([3, 3, 3, 9, 1, 1, 1])]
    batches = [[p.index for p in b] for b in forward_batches(prompts, max_tokens=6, max_prompts=2)]
    assert batches == [[0, 1], [2], [3], [4, 5], [6]]
    # With pages of 4 slots a prompt of 3 tokens takes 4: the KV pool, not the token count, binds.
    paged = [[p.index for p in b] for b in forward_batches(prompts, max_tokens=8, max_prompts=9, page_size=4)]
    assert paged == [[0, 1], [2], [3], [4, 5], [6]]


def test_hashed_records_commit_exactly_the_consumed_prefix():
    source = open_prompts(["a", "b", "", "d", "e"])
    full = HashedRecords(source.records())
    consumed = list(full)
    assert len(consumed) == 5
    digest_3 = full.commit(3)
    resumed = HashedRecords(source.records())
    assert resumed.skip(3) and resumed.hasher.hexdigest() == digest_3
    assert [r.prompt for r in resumed] == ["d", "e"]
    assert resumed.commit(5) == full.commit(5)
    assert not HashedRecords(source.records()).skip(6)
