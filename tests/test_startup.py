"""Start-up structure: `import nnrun` and the CLI's `--help` load only what they use.

The figures (seconds, ratios to `import torch, transformers, nnsight`) are in
benchmarks/startup.py; these tests check the structure that makes them small, not a time.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import nnrun
import nnrun.extract
from nnrun.cli import SUBCOMMANDS, build_parser

REPO = Path(__file__).resolve().parent.parent
# Loaded only by the job that uses them: serving, Ray, FlashInfer, extraction, tensor parallelism.
ON_USE = ["fastapi", "uvicorn", "ray", "flashinfer", "nnrun.serve", "nnrun.extract", "nnrun.tp", "nnrun.distributed"]


def _subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {}
    for name in SUBCOMMANDS:
        parser = build_parser([name])
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parsers[name] = subparsers.choices[name]
    return {"nnrun": build_parser([]), **parsers}


def _shown_default(default) -> list[str]:
    """How a help text may spell `default`: 300.0 as "300.0" or "300"."""
    spellings = [str(default)]
    if isinstance(default, float):
        spellings.append(f"{default:g}")
    return spellings


@pytest.mark.parametrize("name", ["nnrun", *SUBCOMMANDS])
def test_every_flag_has_help_and_its_default(name):
    parser = _subcommand_parsers()[name]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        label = "/".join(action.option_strings) or action.dest
        shown = formatter._expand_help(action) if action.help else ""
        assert shown.strip(), f"nnrun {name}: {label} has no help text"
        if not action.option_strings or action.nargs == 0:
            continue  # a positional is required; a flag such as --quiet is off unless given
        assert "default" in shown or "required" in shown, f"nnrun {name}: {label} does not say its default: {shown!r}"
        if action.default is not None:
            spellings = _shown_default(action.default)
            assert any(s in shown for s in spellings), f"nnrun {name}: {label} shows no {spellings}: {shown!r}"


def test_lazy_exports_resolve():
    for name in nnrun.__all__:
        assert getattr(nnrun, name) is not None, name
    assert sorted(nnrun.extract.__all__) == sorted(nnrun.extract._NAME_TO_MODULE)
    for name in nnrun.extract.__all__:
        assert getattr(nnrun.extract, name) is not None, name
    assert nnrun.config.EngineConfig is not None  # a submodule, after only `import nnrun`
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        nnrun.nope


def _fresh_modules(code: str) -> dict[str, bool]:
    """Which of ON_USE (and torch, transformers) a fresh interpreter holds after running `code`."""
    names = [*ON_USE, "torch", "transformers"]
    probe = f"import sys, json\n{code}\nprint(json.dumps({{m: m in sys.modules for m in {names!r}}}))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_nnrun_loads_nothing_it_does_not_use():
    loaded = _fresh_modules("import nnrun")
    assert not any(loaded.values()), loaded  # not even torch: the engine loads when first named
    loaded = _fresh_modules("import nnrun\nnnrun.LLM\nnnrun.SamplingParams")
    assert loaded["torch"] and not any(loaded[m] for m in ON_USE), loaded  # the engine alone


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in SUBCOMMANDS)])
def test_help_imports_no_torch(argv):
    code = f"from nnrun.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0"
    loaded = _fresh_modules(code)
    own = SUBCOMMANDS[argv[0]][0].rsplit(".", 1)[0] if argv[0] in SUBCOMMANDS else None  # its options' package
    assert not any(value for name, value in loaded.items() if name != own), loaded
