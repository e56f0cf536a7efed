"""`nnrun extract` end to end: each input format, errors, and a real SIGKILL mid-job then resume."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nnrun.cli import main
from nnrun.extract import extract, load_activations
from tolerance import assert_close_packed

REPO = Path(__file__).resolve().parent.parent
WORDS = (
    "the cat sat on a mat while dogs ran in parks near paris and rome where people eat bread "
    "with cheese before going to work at the museum of art every day"
).split()


MODEL = "tiny-facts"  # the bundled model: the CLI resolves the name to nnrun/assets/tiny-facts


def _prompts(count: int, seed: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(count)]


def _write_formats(folder: Path, prompts: list[str]) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {
        "txt": folder / "p.txt",
        "jsonl": folder / "p.jsonl",
        "parquet": folder / "p.parquet",
        "dataset": folder / "p_dataset",
    }
    paths["txt"].write_text("\n".join(prompts) + "\n")
    paths["jsonl"].write_text("\n".join(json.dumps({"id": i, "text": p}) for i, p in enumerate(prompts)) + "\n")
    pq.write_table(pa.table({"text": prompts}), paths["parquet"])
    datasets.Dataset.from_dict({"text": prompts}).save_to_disk(str(paths["dataset"]))
    return paths


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_cli_each_input_format(tmp_path, capsys):
    prompts = _prompts(12, seed=0, max_words=12)
    paths = _write_formats(tmp_path, prompts)
    modules = ["model.layers.0", "model.layers.1.mlp.input"]
    extract(MODEL, prompts, modules, tmp_path / "api", shard_tokens=40, progress=False)
    reference = _hashes(tmp_path / "api")
    for kind, path in paths.items():
        out = tmp_path / f"out_{kind}"
        code = main(
            [
                "extract",
                "--model",
                MODEL,
                "--input",
                str(path),
                "--module",
                *modules,
                "--out",
                str(out),
                "--shard-tokens",
                "40",
            ]
        )
        assert code == 0, kind
        assert "tokens/s" in capsys.readouterr().err
        assert _hashes(out) == reference, kind  # same prompts, same bytes, whatever the format
    store = load_activations(tmp_path / "out_jsonl")
    assert len(store) == len(prompts)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnrun.assets import bundled_model_path

    hf = AutoModelForCausalLM.from_pretrained(bundled_model_path(MODEL)).eval()
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path(MODEL))
    for i in (0, 7):
        ids = tokenizer(prompts[i])["input_ids"]
        assert store[i].token_ids.tolist() == ids
        with torch.no_grad():
            hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]  # [T, H] after layer 0
        assert_close_packed(store[i]["model.layers.0"], hidden, rel=1e-4)


def test_cli_last_positions_dtype_limit_and_quiet(tmp_path, capsys):
    path = tmp_path / "p.txt"
    path.write_text("\n".join(_prompts(6, seed=1, max_words=10)) + "\n")
    code = main(
        [
            "extract",
            "--model",
            MODEL,
            "--input",
            str(path),
            "--module",
            "model.layers.1",
            "--out",
            str(tmp_path / "out"),
            "--positions",
            "last",
            "--dtype",
            "float16",
            "--limit",
            "4",
            "--max-length",
            "8",
            "--truncate",
            "--quiet",
        ]
    )
    assert code == 0 and capsys.readouterr().err == ""
    store = load_activations(tmp_path / "out")
    assert len(store) == 4 and store[0]["model.layers.1"].shape[0] == 1
    assert store[0]["model.layers.1"].dtype == torch.float16
    assert max(store[i].num_tokens for i in range(4)) <= 8


def test_cli_reports_bad_input_and_mismatched_rerun(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "the cat"}\n{"txt": "a dog"}\n')
    out = str(tmp_path / "out")
    args = ["extract", "--model", MODEL, "--input", str(path), "--module", "model.layers.0", "--out", out, "-q"]
    args += ["--text-field", "text"]
    assert main(args) == 1
    assert "p.jsonl line 2: missing text field 'text'" in capsys.readouterr().err
    assert main([*args, "--on-error", "skip"]) == 0
    assert load_activations(out).skipped == [
        {
            "index": 1,
            "line": 2,
            "reason": "missing text field 'text' (fields: txt); name the field that holds the prompt with "
            "--text-field NAME (text_field=NAME in Python)",
        }
    ]
    assert main([*args, "--on-error", "skip", "--positions", "last"]) == 1
    assert "positions: stored 'all', now 'last'" in capsys.readouterr().err


@pytest.mark.slow  # starts a fresh interpreter
def test_cli_sigkill_mid_job_then_resume_is_byte_identical(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("\n".join(_prompts(90, seed=2, max_words=20)) + "\n")
    args = [
        "extract",
        "--model",
        MODEL,
        "--input",
        str(path),
        "--module",
        "model.layers.0",
        "--module",
        "model.layers.1.self_attn.o_proj.input",
        "--shard-tokens",
        "200",
        "--batch-tokens",
        "128",
    ]
    assert main([*args, "--out", str(tmp_path / "ref"), "-q"]) == 0

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(
        [sys.executable, "-m", "nnrun.cli", *args, "--out", str(out), "-q"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not (out / "shard-00000.safetensors").exists():
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, "no shard appeared"
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    killed = load_activations(out)
    assert not killed.is_complete and killed.num_shards < len(load_activations(tmp_path / "ref").manifest.shards)

    assert main([*args, "--out", str(out), "-q"]) == 0
    assert _hashes(out) == _hashes(tmp_path / "ref")
