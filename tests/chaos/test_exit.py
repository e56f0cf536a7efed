"""A script that ends with engines still running exits with its own code, every time.

Each scenario is a small script run many times in child processes: without `shutdown()`, with a
generation or a looping block left running in another thread, through an unhandled exception.
Before `nnrun.lifecycle` these aborted (`terminate called without an active exception`) or crashed
in finalization in most runs. A fresh interpreter spends seconds importing torch, so the runs are
forked from a server that did the imports once: each child runs its scenario as the interpreter's
main script and exits through the interpreter's own finalization, as `python scenario.py` does.
Two fresh interpreters per main scenario check that the forked runs stand for real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PARALLEL = 2  # children at a time (CI machines have 2 cores)
QUICK_RUNS = 4  # runs per scenario by default; `pytest --stress` runs each scenario's full count
RUN_TIMEOUT_S = 60
CRASH_MARKERS = ("terminate called", "Fatal Python error", "Segmentation fault", "core dumped")

SCENARIOS = {  # name: (runs under --stress, the exit code every run must have, the script)
    # Two engines (a LanguageModel and a plain LLM), neither shut down.
    "no_shutdown": (
        50,
        3,
        """
        import sys
        import nnrun

        model = nnrun.LanguageModel("tiny-facts")
        with model.trace("The Eiffel Tower is in"):
            hidden = model.model.layers[1].output.save()
        nnrun.LLM("tiny-facts").generate(["The Colosseum is in"], nnrun.SamplingParams(max_tokens=4))
        sys.exit(3)
    """,
    ),
    # Daemon threads still generating (a traced generation and a plain one) when the main thread exits.
    "daemon_generation": (
        50,
        3,
        """
        import sys
        import threading
        import nnrun

        model = nnrun.LanguageModel("tiny-facts")
        started = threading.Event()

        def traced():
            with model.generate("The Eiffel Tower is in", max_new_tokens=100) as tracer:
                for step in tracer.iter[:]:
                    hidden = model.model.layers[0].output.save()
                    started.set()

        def plain():
            model.engine.generate(["The Colosseum is in"], nnrun.SamplingParams(max_tokens=100, ignore_eos=True))

        threading.Thread(target=traced, daemon=True).start()
        threading.Thread(target=plain, daemon=True).start()
        started.wait(30)
        sys.exit(3)
    """,
    ),
    # A daemon thread's block loops forever: the engine thread is inside it at exit.
    "looping_block": (
        50,
        3,
        """
        import sys
        import threading
        import nnrun

        model = nnrun.LanguageModel("tiny-facts")
        started = threading.Event()

        def loop():
            with model.trace("The Eiffel Tower is in"):
                hidden = model.model.layers[0].output
                started.set()
                while True:
                    pass

        threading.Thread(target=loop, daemon=True).start()
        started.wait(30)
        sys.exit(3)
    """,
    ),
    # A non-daemon thread's generation: the interpreter waits for it, then exits.
    "non_daemon_generation": (
        20,
        3,
        """
        import sys
        import threading
        import nnrun

        model = nnrun.LanguageModel("tiny-facts")
        started = threading.Event()

        def traced():
            with model.generate("The Eiffel Tower is in", max_new_tokens=60) as tracer:
                for step in tracer.iter[:]:
                    hidden = model.model.layers[0].output.save()
                    started.set()

        threading.Thread(target=traced).start()
        started.wait(30)
        sys.exit(3)
    """,
    ),
    # Exit through an unhandled exception (code 1), engine not shut down.
    "unhandled_exception": (
        20,
        1,
        """
        import nnrun

        model = nnrun.LanguageModel("tiny-facts")
        with model.trace("The Eiffel Tower is in"):
            hidden = model.model.layers[1].output.save()
        raise ValueError("the script fails after its trace")
    """,
    ),
    # A block that swallows every exception in its loop: the engine thread is parked at exit.
    "swallowing_block": (
        10,
        3,
        """
        import sys
        import threading
        import nnrun

        model = nnrun.LanguageModel("tiny-facts")
        started = threading.Event()

        def loop():
            with model.trace("The Eiffel Tower is in"):
                hidden = model.model.layers[0].output
                started.set()
                while True:
                    try:
                        while True:
                            pass
                    except BaseException:
                        pass

        threading.Thread(target=loop, daemon=True).start()
        started.wait(30)
        sys.exit(3)
    """,
    ),
}

FORK_SERVER = f"""
import gc, json, os, signal, sys, time

import interleaver.model  # noqa: F401  (imports only: no torch op may run before fork)
import nnrun  # noqa: F401

plan, out_dir = json.load(open(sys.argv[1])), sys.argv[2]
gc.freeze()  # the children's final collections then leave the parent's pages alone
jobs = [(name, run) for name, (script, num_runs) in plan.items() for run in range(num_runs)]
running, results, child = {{}}, {{}}, None
while child is None and (jobs or running):
    while jobs and len(running) < {PARALLEL}:
        job = jobs.pop(0)
        pid = os.fork()
        if pid == 0:
            child = job
            break
        running[pid] = (job, time.monotonic())
    if child is not None:
        break
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid:
        (name, run), _ = running.pop(pid)
        results.setdefault(name, {{}})[run] = os.waitstatus_to_exitcode(status)
        continue
    for pid, ((name, run), started) in list(running.items()):
        if time.monotonic() - started > {RUN_TIMEOUT_S}:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            results.setdefault(name, {{}})[run] = "timeout"
            del running[pid]
    time.sleep(0.005)

if child is None:
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f)
    sys.exit(0)

# A child: its scenario runs as this interpreter's main script, then the interpreter exits.
name, run = child
log = os.open(os.path.join(out_dir, f"{{name}}-{{run}}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(log, 1)
os.dup2(log, 2)
script = plan[name][0]
sys.argv = [script]
with open(script) as f:
    code = compile(f.read(), script, "exec")
exec(code, {{"__name__": "__main__", "__file__": script}})
"""


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def _write_scenarios(directory: Path) -> dict[str, Path]:
    paths = {}
    for name, (_, _, source) in SCENARIOS.items():
        paths[name] = directory / f"{name}.py"
        paths[name].write_text(textwrap.dedent(source))
    return paths


def num_runs(scenario: str, stress: bool) -> int:
    """How many forked runs of `scenario`: a few by default, its full count (the failure rates seen) under --stress."""
    full = SCENARIOS[scenario][0]
    return full if stress else min(full, QUICK_RUNS)


@pytest.fixture(scope="module")
def forked_runs(tmp_path_factory, request) -> tuple[dict[str, dict[str, int | str]], Path]:
    """Every scenario's runs: {scenario: {run: exit code or "timeout"}}, and the folder of their logs."""
    directory = tmp_path_factory.mktemp("exit")
    scripts = _write_scenarios(directory)
    plan = directory / "plan.json"
    stress = request.config.getoption("--stress")
    plan.write_text(json.dumps({name: (str(scripts[name]), num_runs(name, stress)) for name in SCENARIOS}))
    server = directory / "fork_server.py"
    server.write_text(FORK_SERVER)
    logs = directory / "logs"
    logs.mkdir()
    subprocess.run([sys.executable, str(server), str(plan), str(logs)], env=_env(), timeout=600, check=True)
    return json.loads((logs / "results.json").read_text()), logs


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_run_exits_with_its_own_code(forked_runs, scenario, request):
    results, logs = forked_runs
    _, code, _ = SCENARIOS[scenario]
    runs = num_runs(scenario, request.config.getoption("--stress"))
    codes = results[scenario]
    assert len(codes) == runs
    failures = {run: got for run, got in codes.items() if got != code}
    crashes = {
        run: marker
        for run in codes
        for marker in CRASH_MARKERS
        if marker in (logs / f"{scenario}-{run}.log").read_text(errors="replace")
    }
    example = next(iter(failures or crashes), None)
    detail = "" if example is None else (logs / f"{scenario}-{example}.log").read_text(errors="replace")[-2000:]
    assert not failures and not crashes, (
        f"{scenario}: {len(failures)} of {runs} runs exited with another code than {code} {failures}, "
        f"{len(crashes)} logged a crash {crashes}; run {example}'s log ends with:\n{detail}"
    )


def test_fresh_interpreters_exit_with_their_own_code(tmp_path):
    """The main scenarios in plain `python scenario.py` processes, as a user runs them."""
    scripts = _write_scenarios(tmp_path)
    names = ["no_shutdown", "daemon_generation", "looping_block"] * 2

    def run(name: str) -> tuple[str, subprocess.CompletedProcess]:
        return name, subprocess.run(
            [sys.executable, str(scripts[name])], env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S * 2
        )

    with ThreadPoolExecutor(PARALLEL) as pool:
        for name, proc in pool.map(run, names):
            assert proc.returncode == SCENARIOS[name][1], f"{name}: exit code {proc.returncode}\n{proc.stderr[-2000:]}"
            assert not any(marker in proc.stderr for marker in CRASH_MARKERS), proc.stderr[-2000:]
