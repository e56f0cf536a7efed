"""Start-up cost: `import nnrun` and the CLI's `--help` against `import torch, transformers, nnsight`.

Each figure is the best of N fresh interpreters (wall-clock seconds, the interpreter's own start
included), run from the repository root so that this checkout's `nnrun` is the one imported:

  baseline           python -c "import torch, transformers, nnsight"
  import nnrun       python -c "import nnrun"                (target: at most 1.3x the baseline)
  HF model code      the baseline plus transformers.PreTrainedModel (what loading any HF model imports)
  nnrun.LLM          python -c "import nnrun; nnrun.LLM"     (the engine's modules, loaded on first use)
  nnrun --help       python -m nnrun.cli --help              (target: under a second)
  nnrun <cmd> --help for every subcommand                    (target: under a second)

    python benchmarks/startup.py [--repeats 3] [--importtime]

`--importtime` also prints the ten slowest modules under `import nnrun` (`python -X importtime`).
The machine's load moves every figure; the ratios to the baseline, taken in the same run, mean more.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nnrun.cli import SUBCOMMANDS  # noqa: E402  (the CLI module imports no torch)


def best_of(argv: list[str], repeats: int) -> float:
    """The fastest of `repeats` runs of `argv` in a fresh interpreter, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return min(times)


def slowest_imports(statement: str, count: int = 10) -> list[tuple[float, str]]:
    """The `count` modules with the largest cumulative import time under `statement`, in seconds."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], cwd=REPO, capture_output=True, text=True, check=True
    )
    rows = []
    for line in result.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    return sorted(rows, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh interpreters per figure; the best counts")
    parser.add_argument("--importtime", action="store_true", help="also list the slowest imports of `import nnrun`")
    args = parser.parse_args()
    python = sys.executable
    rows = [
        ("import torch, transformers, nnsight", [python, "-c", "import torch, transformers, nnsight"]),
        ("import nnrun", [python, "-c", "import nnrun"]),
        (
            "baseline + transformers.PreTrainedModel",
            [python, "-c", "import torch, transformers, nnsight; transformers.PreTrainedModel"],
        ),
        ("import nnrun; nnrun.LLM", [python, "-c", "import nnrun; nnrun.LLM"]),
        ("nnrun --help", [python, "-m", "nnrun.cli", "--help"]),
        *((f"nnrun {name} --help", [python, "-m", "nnrun.cli", name, "--help"]) for name in SUBCOMMANDS),
    ]
    baseline = None
    print(f"{'command':<40} {'best s':>8} {'x baseline':>11}   (best of {args.repeats}; {python})")
    for label, argv in rows:
        seconds = best_of(argv, args.repeats)
        baseline = baseline or seconds
        print(f"{label:<40} {seconds:>8.2f} {seconds / baseline:>10.2f}x")
    if args.importtime:
        print("\nslowest modules under `import nnrun` (cumulative s):")
        for seconds, name in slowest_imports("import nnrun"):
            print(f"  {seconds:6.2f}  {name.strip()}")


if __name__ == "__main__":
    main()
