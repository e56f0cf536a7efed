"""Package boundaries and runner properties."""

import subprocess
import sys
import textwrap

import pytest

import nnrun
from model_zoo import make_model


@pytest.mark.slow  # starts a fresh interpreter
def test_engine_runs_without_importing_nnsight():
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        import nnrun
        from model_zoo import make_model
        with nnrun.LLM(make_model("llama")) as llm:
            llm.generate([[1, 2, 3]], nnrun.SamplingParams(max_tokens=2))
        assert not any(name == "nnsight" or name.startswith("nnsight.") for name in sys.modules), "nnsight imported"
        assert "interleaver" not in sys.modules
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_runner_reports_sliding_window_and_generation():
    with nnrun.LLM(make_model("mistral")) as llm:
        assert llm.runner.sliding_window_size == 24 and llm.runner.is_generation
    with nnrun.LLM(make_model("llama")) as llm:
        assert llm.runner.sliding_window_size is None
        assert [layer.layer_idx for layer in llm.runner.layers] == [0, 1]
