"""benchmarks/gpu.py: its roofline arithmetic against hand-counted values, and a tiny run on CPU."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
TINY_RUN = [
    "--shape",
    "tiny",
    "--device",
    "cpu",
    "--batches",
    "1,2",
    "--prompt-len",
    "16",
    "--decode-prompt-len",
    "16",
    "--new-tokens",
    "8",
    "--extract-prompts",
    "16",
    "--repeats",
    "2",
]
TIMEOUT_S = 120


def load_benchmark_common():
    """benchmarks/common.py under a name of its own: `common` is too generic to put on sys.path here."""
    spec = importlib.util.spec_from_file_location("nnrun_benchmarks_common", BENCHMARKS_DIR / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_benchmark_common()


def test_parameter_counts_match_the_published_models():
    # Tiny, counted by hand: per layer q 64*64 + k 64*32 + v 64*32 + o 64*64 + mlp 3*64*128 + norms 2*64
    # = 36992; 2 layers + final norm 64 = 74048; tied embedding 256*64 = 16384.
    tiny = bench.shape_config("tiny")
    assert bench.non_embedding_params(tiny) == 74_048
    # Llama-3.2-1B has 1,235,814,400 parameters (tied), Llama-3-8B 8,030,261,248 (untied).
    llama_1b, llama_8b = bench.shape_config("1b"), bench.shape_config("8b")
    assert bench.non_embedding_params(llama_1b) + 128_256 * 2048 == 1_235_814_400
    assert bench.non_embedding_params(llama_8b) + 2 * 128_256 * 4096 == 8_030_261_248


def test_tiny_shape_builds_the_model_the_counts_describe():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(bench.shape_config("tiny"))
    assert sum(p.numel() for p in model.parameters()) == 90_432  # 74048 + one tied 256x64 table


def test_prefill_flops_of_the_tiny_shape():
    tiny = bench.shape_config("tiny")
    # Two prompts of 8: weights 2*74048*16 = 2,369,536; attention 2*2*2 layers*64*(32+32) = 32,768;
    # LM head on 2 rows 2*256*64*2 = 65,536.
    assert bench.prefill_flops(tiny, [8, 8]) == 2_467_840
    # Prompts of 3 and 5: weights 2*74048*8 = 1,184,768; attention 8*64*(4.5+12.5) = 8,704; head 65,536.
    assert bench.prefill_flops(tiny, [3, 5]) == 1_259_008


def test_decode_step_bytes():
    # Tiny fp32, 2 sequences of 10 tokens: weights 90432*4 = 361,728; K and V 2*2*2*16 = 128 values
    # per token, *10*2 tokens *4 bytes = 10,240.
    assert bench.decode_step_bytes(bench.shape_config("tiny"), 4, 2, 10) == 371_968
    # 8B bf16, one sequence, empty context: (6,979,588,096 + LM head 525,336,576) * 2 bytes; the input
    # embedding is only gathered.
    assert bench.decode_step_bytes(bench.shape_config("8b"), 2, 1, 0) == 15_009_849_344


def test_device_peaks():
    assert bench.device_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert bench.device_peaks("NVIDIA H200") == (989e12, 4.8e12)
    assert bench.device_peaks("NVIDIA A100-SXM4-80GB") is None


def markdown_tables(output: str) -> dict[str, list[list[str]]]:
    """Section name -> the cells of each body row of the table under its `## name` heading."""
    tables: dict[str, list[list[str]]] = {}
    section = None
    for line in output.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            tables[section] = []
        elif section and line.startswith("| ") and not line.startswith("|---"):
            tables[section].append([cell.strip() for cell in line.strip("|").split("|")])
    return {name: rows[1:] for name, rows in tables.items()}  # rows[0] is the header


@pytest.mark.slow
def test_tiny_run_on_cpu_prints_every_table_with_positive_ratios(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS_DIR / "gpu.py"), *TINY_RUN, "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "attention backend torch" in done.stdout and "command: python " in done.stdout
    tables = markdown_tables(done.stdout)
    assert list(tables) == ["prefill", "decode", "extract"]
    assert [row[0] for row in tables["prefill"]] == ["1", "2"]
    assert [row[0] for row in tables["decode"]] == ["1", "2"]
    assert [row[0] for row in tables["extract"]] == ["16"]
    for section, rows in tables.items():
        for row in rows:
            nnrun_rate, hf_rate, ratio = float(row[2]), float(row[3]), float(row[4].removesuffix("x"))
            assert nnrun_rate > 0 and hf_rate > 0 and ratio > 0, (section, row)
            if section != "extract":
                assert row[5] == "n/a", "no peak FLOP/s or bandwidth is known for a CPU"
    report = json.loads(out.read_text())
    assert all(row["ratio"] > 0 for rows in report["sections"].values() for row in rows)
    assert set(report["elapsed_s"]) == {"prefill", "decode", "extract"}
