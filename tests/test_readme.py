"""The README's quickstart is code users paste first: it must run and print what it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow  # starts a fresh interpreter
def test_quickstart_runs_and_predicts_paris():
    quickstart = python_blocks()[0]
    done = subprocess.run([sys.executable, "-c", quickstart], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert " Paris" in done.stdout and " Rome" in done.stdout


def test_readme_keeps_the_two_setup_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
