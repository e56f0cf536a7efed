"""The example scripts run with their defaults on the bundled model and print what they should."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
SHARED_MODULES = {"common.py"}
# script -> lines its default run prints (on tiny-facts, whose facts and circuits are known)
EXAMPLE_TO_EXPECTED = {
    "quickstart.py": ["next token: ' Paris' 1.00", "edited: 'The Louvre Museum is in Tokyo.'"],
    "generate.py": ["'The Eiffel Tower is in' -> ' Paris.' (stop)", "-> ' Paris' (stopped by '.')"],
    "activation_patching.py": ["block 1: strongest at position 7 '_Museum'", "block 3: strongest at position 9 '_in'"],
    "logit_lens.py": ["the model's answer is ' Paris'"],
    "steering.py": ["without: ' Paris.'", "steered: ' Rome.'", "steered: ' Italian.'", "steered: ' painter.'"],
    "extract_and_probe.py": ["country: 56 prompts, 10 classes", "extracted 100 prompts"],
}
PLOTTING_EXAMPLES = ["activation_patching.py", "logit_lens.py", "steering.py", "extract_and_probe.py"]
TIMEOUT_S = 300


def run_example(script: str, *args: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / script), *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, f"{script} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def test_every_example_is_listed_here():
    scripts = {path.name for path in EXAMPLES_DIR.glob("*.py")} - SHARED_MODULES
    assert scripts == set(EXAMPLE_TO_EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXAMPLE_TO_EXPECTED))
def test_example_runs_with_defaults(script, tmp_path):
    output = run_example(script, cwd=tmp_path)
    for expected in EXAMPLE_TO_EXPECTED[script]:
        assert expected in output, f"{script} did not print {expected!r}:\n{output}"
    assert not list(tmp_path.iterdir()), "an example writes files only when asked (--plot)"


# Runs each plotting example's main() with --plot in one process, so torch and nnrun load once.
PLOT_DRIVER = """
import importlib, sys
examples_dir, *pairs = sys.argv[1:]
sys.path.insert(0, examples_dir)
for script, figure in zip(pairs[::2], pairs[1::2]):
    sys.argv = [script, "--plot", figure]
    importlib.import_module(script.removesuffix(".py")).main()
"""


@pytest.mark.slow
def test_examples_plot_when_asked(tmp_path):
    figures = [tmp_path / script.replace(".py", ".png") for script in PLOTTING_EXAMPLES]
    pairs = [str(item) for script, figure in zip(PLOTTING_EXAMPLES, figures) for item in (script, figure)]
    result = subprocess.run(
        [sys.executable, "-c", PLOT_DRIVER, str(EXAMPLES_DIR), *pairs],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    for figure in figures:
        assert f"wrote {figure}" in result.stdout
        assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000, figure
