"""A script that starts tensor parallelism without the main guard is refused in the parent, at once."""

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_unguarded_script_fails_in_the_parent_naming_the_guard(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text('import nnrun\n\nllm = nnrun.LLM("tiny-facts", tensor_parallel_size=2)\nprint("built")\n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's nnrun
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.monotonic() - start
    assert done.returncode == 1 and "built" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("nnrun.tp.main_guard.MainGuardError: ")
    assert f"{script}, line 3" in last and 'under `if __name__ == "__main__":`' in last
    assert "exited with code" not in done.stderr and "rank 1" not in done.stderr  # no rank was started
    # The same interpreter just importing the engine, for scale: the refusal adds no rank start-up or load.
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import nnrun; nnrun.LLM"], env=env, check=True, timeout=300)
    assert elapsed < 3 * (time.monotonic() - start) + 10, elapsed
