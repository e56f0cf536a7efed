"""benchmarks/gpu.py's `interventions` section and benchmarks/interventions.py's generation rows, tiny runs on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
ROWS = [
    "engine.generate",
    "traced, nothing inside",
    "one layer saved every step",
    "last row of one layer saved every step",
    "all layers saved every step",
    "steering vector every step",
    "prefill trace, one layer read per invoke",
    "engine prefill alone",
    "HF generate",
    "nnsight on HF, traced, nothing inside",
    "nnsight on HF, one layer saved every step",
    "nnsight on HF, steering vector every step",
    "nnsight on HF, prefill trace, one layer read per invoke",
]
PREFILL_TRACE = "prefill trace, one layer read per invoke"
PREFILL_FLOOR = "engine prefill alone"
TIMEOUT_S = 180


def table_rows(output: str) -> dict[str, list[str]]:
    """Workload -> its cells, from the markdown table the benchmark prints."""
    rows = {}
    for line in output.splitlines():
        if line.startswith("| ") and not line.startswith(("| workload", "|---")):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def run(script: str, *args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS_DIR / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


def check_rows(rows: dict[str, list[str]]) -> None:
    assert list(rows) == ROWS
    for name, (seconds, vs_engine, vs_nnsight, per_value) in rows.items():
        assert float(seconds) > 0 and float(vs_engine.removesuffix("x")) > 0, name
        against = PREFILL_TRACE if name == PREFILL_FLOOR else name
        assert (vs_nnsight != "-") == (name in ROWS[1:8] and f"nnsight on HF, {against}" in rows), name
        assert (per_value != "-") == ("saved" in name and not name.startswith("nnsight")), name
    # The prefill trace's ceiling: nnsight on HF's prefill trace over the engine's prefill alone (the floor row).
    floor_ratio = rows[PREFILL_FLOOR][2]
    assert rows[PREFILL_TRACE][2].endswith(f" (ceiling {floor_ratio})")
    nnsight_s, floor_s = float(rows[f"nnsight on HF, {PREFILL_TRACE}"][0]), float(rows[PREFILL_FLOOR][0])
    half = 0.0005  # the seconds are printed to 3 decimals, the ratio to 2
    lowest, highest = (nnsight_s - half) / (floor_s + half), (nnsight_s + half) / max(floor_s - half, 1e-9)
    assert lowest - 0.005 <= float(floor_ratio.removesuffix("x")) <= highest + 0.005


PROFILE_HEADING = "## interventions: per decode step"
PROFILED_ROWS = [
    "engine.generate",
    "traced, nothing inside",
    "one layer saved every step",
    "steering vector every step",
]


def check_profile(printed: dict[str, list[str]], report: list[dict]) -> None:
    """`--profile-rows` on a CPU: a table row per profiled workload; no kernels; over the whole profiled call, the
    engine alone hands nothing to a block and copies no saved value, while the rows that read or steer a layer
    every step hand it to their blocks. (Per-step figures are differences of two calls' times: noise on a CPU.)"""
    assert list(printed) == PROFILED_ROWS
    for name, cells in printed.items():
        assert (cells[1], cells[3]) == ("0.00", "0"), name  # GPU busy ms, kernel launches (the idle share: noise)
    calls = {row["workload"]: row["profile"]["call_us"] for row in report if row["profile"]}
    assert list(calls) == PROFILED_ROWS
    assert calls["engine.generate"]["handoffs"] == 0 and calls["engine.generate"]["end of step"] == 0
    for name in PROFILED_ROWS:
        assert calls[name]["wall"] > 0 and calls[name]["step"] > 0, name
    assert calls["one layer saved every step"]["handoffs"] > 0 and calls["steering vector every step"]["handoffs"] > 0


@pytest.mark.slow
def test_gpu_benchmark_interventions_section_on_cpu(tmp_path):
    out = tmp_path / "results.json"
    output = run(
        "gpu.py",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--only",
        "interventions",
        "--repeats",
        "1",
        "--profile-rows",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    rows_table, _, profile_table = output.partition(PROFILE_HEADING)
    assert "## interventions" in rows_table and profile_table
    check_rows(table_rows(rows_table))
    check_profile(table_rows(profile_table), json.loads(out.read_text())["sections"]["interventions"])


@pytest.mark.slow
def test_interventions_generation_rows_on_a_small_llama(tmp_path):
    output = run(
        "interventions.py",
        "--only",
        "generation",
        "--gen-prompts",
        "3",
        "--gen-tokens",
        "3",
        "--gen-layers",
        "2",
        "--gen-hidden",
        "64",
        "--gen-repeats",
        "1",
        cwd=tmp_path,
    )
    check_rows(table_rows(output))
