"""Extraction folders that never lie: appended or changed inputs, corrupted shards and manifests, bad text.

The oracle throughout is an uninterrupted run into a fresh folder: a folder that was extended,
resumed or repaired must end with the same files, byte for byte (sha256 of every file).
"""

import hashlib
import json
import shutil
import warnings

import pytest

import nnrun
from model_zoo import make_model, random_prompts
from nnrun.cli import main
from nnrun.extract import (
    DamagedFolderError,
    FolderRepairWarning,
    InputError,
    SettingsMismatchError,
    extract,
    load_activations,
)
from nnrun.extract.manifest import FORMAT, Manifest

MODEL = "tiny-facts"  # the bundled model, for the command line
MODULES = ["model.layers.0", "model.layers.1.mlp.input"]
SHARD_TOKENS = 20  # several shards from a dozen short prompts


@pytest.fixture(scope="module")
def llm():
    engine = nnrun.LLM(make_model("llama"), max_num_batched_tokens=64)
    yield engine
    engine.shutdown()


def _prompts() -> list:
    """Token-id prompts with bad items (an empty list, an id outside the vocabulary of 256) among them."""
    prompts: list = random_prompts([5, 9, 3, 12, 7, 4, 10, 6, 8, 2, 11, 5, 7, 3], seed=4)
    prompts.insert(4, [])
    prompts.insert(9, [300])
    prompts.insert(10, [])
    return prompts


def _extract(llm, prompts, out_dir, **kwargs):
    return extract(llm, prompts, MODULES, out_dir, shard_tokens=SHARD_TOKENS, on_error="skip", progress=False, **kwargs)


def _files(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def reference(llm, tmp_path_factory):
    """An uninterrupted run over `_prompts()`: the folder every other run must end equal to."""
    folder = tmp_path_factory.mktemp("reference")
    summary = _extract(llm, _prompts(), folder)
    assert summary.is_complete and summary.num_shards >= 4 and summary.num_skipped == 3
    return folder


# ---- item 1: a complete folder re-run with another input ----------------------------------------


@pytest.mark.parametrize("num_old", [0, 3, 5, 9, 11, 16])
def test_complete_folder_with_appended_input_is_extended_byte_identical(llm, reference, tmp_path, num_old):
    prompts = _prompts()
    _extract(llm, prompts[:num_old], tmp_path)
    assert load_activations(tmp_path).is_complete
    summary = _extract(llm, prompts, tmp_path)
    assert summary.is_complete and summary.num_new_prompts > 0
    assert _files(tmp_path) == _files(reference)


def test_extension_killed_midway_then_resumed_is_byte_identical(llm, reference, tmp_path, monkeypatch):
    import nnrun.extract.committer as committer

    prompts = _prompts()
    _extract(llm, prompts[:11], tmp_path)

    def die(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(committer, "write_shard", die)
    with pytest.raises(KeyboardInterrupt):
        _extract(llm, prompts, tmp_path)
    monkeypatch.undo()
    assert not load_activations(tmp_path, verify=True).is_complete  # cut back to before its open last shard
    _extract(llm, prompts, tmp_path)
    assert _files(tmp_path) == _files(reference)


def test_complete_folder_with_same_input_is_left_alone(llm, reference, tmp_path):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    summary = _extract(llm, _prompts(), tmp_path)
    assert summary.num_new_prompts == 0 and summary.is_complete
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps


@pytest.mark.parametrize("change", ["edited", "shorter", "inserted"])
def test_complete_folder_with_other_input_is_refused(llm, reference, tmp_path, change):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    prompts = _prompts()
    if change == "edited":
        prompts[6] = prompts[6][::-1]
    elif change == "shorter":
        prompts = prompts[:-1]
    else:
        prompts.insert(0, [7, 7])
    with pytest.raises(SettingsMismatchError, match=rf"{tmp_path}.*new --out folder.*delete"):
        _extract(llm, prompts, tmp_path)
    assert _files(tmp_path) == _files(reference)


def test_cli_extends_an_appended_input_and_refuses_another(tmp_path, capsys):
    lines = [f"the cat sat on the mat {i}" if i % 3 else f"a dog ran in the park {i}" for i in range(12)]
    path = tmp_path / "p.txt"
    args = [
        "extract",
        "--model",
        MODEL,
        "--input",
        str(path),
        "--module",
        "model.layers.0",
        "--shard-tokens",
        "30",
        "-q",
    ]
    path.write_text("\n".join(lines) + "\n")
    assert main([*args, "--out", str(tmp_path / "ref")]) == 0
    path.write_text("\n".join(lines[:7]) + "\n")
    assert main([*args, "--out", str(tmp_path / "run")]) == 0
    path.write_text("\n".join(lines) + "\n")
    assert main([*args, "--out", str(tmp_path / "run")]) == 0
    assert _files(tmp_path / "run") == _files(tmp_path / "ref")
    path.write_text("\n".join(lines[:5] + ["something else"] + lines[6:]) + "\n")
    assert main([*args, "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "run") in err and "first 12 items" in err and "new --out folder" in err
    assert _files(tmp_path / "run") == _files(tmp_path / "ref")


# ---- item 2: corrupted shards and manifests -----------------------------------------------------


def _flip(path, position: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= mask
    path.write_bytes(bytes(data))


def _edit_manifest(folder, edit) -> None:
    """Apply `edit` to the manifest's JSON and save it as a still valid manifest."""
    data = json.loads((folder / "manifest.json").read_text())
    edit(data)
    (folder / "manifest.json").write_text(Manifest.from_text(json.dumps({**data, "format": FORMAT})).to_text())


SHARD_1 = "shard-00001.safetensors"


def _first_row_of_shard(data: dict, shard: int) -> int:
    return data["prompts"]["shard"].index(shard)


def _corrupt(folder, kind: str) -> str:
    """Damage `folder` in one way (all but "truncated" and "missing" keep the size); return the file at fault."""
    shard = folder / SHARD_1
    size = shard.stat().st_size
    if kind == "zeroed":
        data = bytearray(shard.read_bytes())
        data[size // 2 : size // 2 + 64] = bytes(64)
        shard.write_bytes(bytes(data))
    elif kind == "flipped_data":
        _flip(shard, size - 1, 0x80)
    elif kind == "flipped_header":
        header = shard.read_bytes()[:200]
        _flip(shard, header.index(b'shape":[') + 8, 0x01)  # a shape's first digit: still valid JSON
    elif kind == "truncated":
        shard.write_bytes(shard.read_bytes()[:-8])
    elif kind == "missing":
        shard.unlink()
    elif kind in ("offset", "token_offset"):

        def edit(data, column=kind):
            row = _first_row_of_shard(data, 1) + 1
            data["prompts"][column][row] += 1

        _edit_manifest(folder, edit)
        return "manifest.json"
    elif kind == "manifest_sha256":

        def edit(data):
            data["shards"][1]["sha256"] = "0" * 64

        _edit_manifest(folder, edit)
    else:
        raise AssertionError(kind)
    return SHARD_1


CORRUPTIONS = [
    "zeroed",
    "flipped_data",
    "flipped_header",
    "truncated",
    "missing",
    "offset",
    "token_offset",
    "manifest_sha256",
]


def test_intact_folder_verifies(reference, capsys):
    store = load_activations(reference, verify=True)
    assert len(store) == len(_prompts()) - 3
    assert main(["extract", "--verify", str(reference)]) == 0
    out = capsys.readouterr().out
    assert "intact" in out and str(reference) in out


def test_folder_of_last_positions_in_bfloat16_verifies(llm, tmp_path):
    _extract(llm, _prompts(), tmp_path, positions="last", dtype="bfloat16")
    assert load_activations(tmp_path, verify=True).num_shards >= 4


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corruption_is_detected_by_verify(reference, tmp_path, capsys, kind):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    culprit = _corrupt(tmp_path, kind)
    load_activations(tmp_path)  # opening without verify reads only the manifest
    with pytest.raises(DamagedFolderError, match=rf"{culprit}"):
        load_activations(tmp_path, verify=True)
    assert main(["extract", "--verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert culprit in err and "damaged" in err


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_rerun_redoes_from_the_damaged_shard_byte_identical(llm, reference, tmp_path, kind):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    _corrupt(tmp_path, kind)
    with pytest.warns(FolderRepairWarning, match=rf"{SHARD_1}.*redo"):
        summary = _extract(llm, _prompts(), tmp_path)
    assert summary.num_resumed_shards == 1 and summary.is_complete
    assert _files(tmp_path) == _files(reference)


def test_resume_after_a_kill_verifies_the_last_complete_shard(llm, reference, tmp_path, monkeypatch):
    import nnrun.extract.committer as committer

    real_write, calls = committer.write_shard, []

    def write_then_die(*args):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real_write(*args)

    monkeypatch.setattr(committer, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        _extract(llm, _prompts(), tmp_path)
    monkeypatch.undo()
    assert len(load_activations(tmp_path).manifest.shards) == 2
    _corrupt(tmp_path, "zeroed")  # the last complete shard, shard 1
    with pytest.warns(FolderRepairWarning, match=SHARD_1):
        _extract(llm, _prompts(), tmp_path)
    assert _files(tmp_path) == _files(reference)


def test_damage_that_names_no_shard_is_refused(llm, reference, tmp_path, capsys):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)

    def edit(data):
        data["num_consumed"] = 2  # fewer input items than the prompts it lists

    _edit_manifest(tmp_path, edit)
    before = _files(tmp_path)
    with pytest.raises(DamagedFolderError, match=r"manifest.json.*num_consumed.*new --out folder"):
        _extract(llm, _prompts(), tmp_path)
    assert _files(tmp_path) == before
    assert main(["extract", "--verify", str(tmp_path)]) == 1
    assert "num_consumed" in capsys.readouterr().err


def test_cli_verify_is_its_own_mode(tmp_path, capsys):
    assert main(["extract", "--verify", str(tmp_path)]) == 1
    assert "no manifest.json" in capsys.readouterr().err
    assert main(["extract", "--verify", str(tmp_path), "--model", MODEL]) == 2
    assert "--verify" in capsys.readouterr().err
    assert main(["extract", "--out", str(tmp_path / "x")]) == 2
    assert "--model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["extract", "--verify", str(tmp_path), "--out", str(tmp_path)])  # argparse: not allowed together


# ---- item 3: text that is not valid Unicode ----------------------------------------------------


def test_lone_surrogate_in_a_python_prompt_follows_on_error(tiny_llm, tmp_path):
    llm, tokenizer = tiny_llm
    prompts = ["The cat sat", "bad \udcff text", "A dog ran"]
    summary = extract(llm, prompts, "model.layers.0", tmp_path / "skip", on_error="skip", progress=False)
    store = load_activations(tmp_path / "skip", verify=True)
    assert summary.num_skipped == 1 and len(store) == 2 and store[1].input_index == 2
    assert store.skipped[0]["index"] == 1 and "lone surrogate '\\udcff'" in store.skipped[0]["reason"]
    assert store[1].token_ids.tolist() == tokenizer("A dog ran")["input_ids"]
    with pytest.raises(InputError, match=r"item 1: .*lone surrogate '\\udcff' at character 4"):
        extract(llm, prompts, "model.layers.0", tmp_path / "stop", progress=False)


def test_lone_surrogate_in_jsonl_follows_on_error_in_the_cli(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["the cat", "bad \udcff", "a dog"]) + "\n")
    assert "\\udcff" in path.read_text()  # JSON's escape: the file itself is valid UTF-8
    args = ["extract", "--model", MODEL, "--input", str(path), "--module", "model.layers.0", "-q"]
    assert main([*args, "--out", str(tmp_path / "stop")]) == 1
    assert "p.jsonl line 2: the text holds a lone surrogate" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "skip"), "--on-error", "skip"]) == 0
    store = load_activations(tmp_path / "skip")
    assert len(store) == 2 and store.skipped[0]["line"] == 2 and "surrogate" in store.skipped[0]["reason"]


class _FailingTokenizer:
    """The real tokenizer, except that a text holding "boom" makes the whole call raise."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __call__(self, texts, **kwargs):
        batch = [texts] if isinstance(texts, str) else texts
        if any("boom" in text for text in batch):
            raise ValueError("the tokenizer cannot encode this text")
        return self._tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_tokenizer_failure_on_one_item_follows_on_error(tiny_llm, tmp_path, monkeypatch):
    llm, tokenizer = tiny_llm
    monkeypatch.setattr(llm, "tokenizer", _FailingTokenizer(tokenizer))
    prompts = ["The cat sat", "boom", "A dog ran", "Paris"]
    extract(llm, prompts, "model.layers.0", tmp_path / "skip", on_error="skip", progress=False)
    store = load_activations(tmp_path / "skip")
    assert [store[i].input_index for i in range(len(store))] == [0, 2, 3]
    assert store.skipped == [
        {"index": 1, "line": None, "reason": "the tokenizer failed: ValueError: the tokenizer cannot encode this text"}
    ]
    assert [store[i].token_ids.tolist() for i in range(3)] == [
        tokenizer(p)["input_ids"] for p in prompts if p != "boom"
    ]
    with pytest.raises(InputError, match="item 1: the tokenizer failed"):
        extract(llm, prompts, "model.layers.0", tmp_path / "stop", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an intact resume warns of nothing
        extract(llm, prompts, "model.layers.0", tmp_path / "skip", on_error="skip", progress=False)
