"""`nnrun serve` against the same traces run in-process: throughput and p50/p99 latency.

For each N in --clients (default 1 4 16): N client processes each send --traces small traces
(one prompt; a layer's last-position output saved) one after another to `nnrun serve MODEL` on
127.0.0.1; the in-process baseline runs the same traces from N threads on one
`nnrun.LanguageModel`. With --separate, N processes each loading their own nnsight + HF model
run the same traces: total resident memory (one copy of the weights vs N) and throughput side by
side. Clients start timing only once all of them have imported and connected (a start file).
Prints traces/s, latency percentiles and the ratios, and the CPU time each trace cost in each
process (server, clients, in-process engine): on a CPU with few cores the clients and the
server compete for the same cores, and that line says where the time went. It also prints how many
requests shared an engine forward on each side (the server's counters from `/health`): a short
trace's forward costs mostly its fixed part, so fewer requests per forward is less throughput. With --pin the
server (and the in-process run) get CPU 0 and the clients the other CPUs, as notebooks on
their own machines or cores would leave the server's core alone. On a shared CPU only the
ratios mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
ALL_CPUS = set(os.sched_getaffinity(0))
PROMPTS = ["The Eiffel Tower is in", "The Colosseum is in", "The Louvre Museum is in", "The Trevi Fountain is in"]


def one_trace(model, prompt: str, layer: int):
    with model.trace(prompt):
        hidden = model.model.layers[layer].output[:, -1].save()
    return hidden


def cpu_s(pid: int | str = "self") -> float:
    """User + system CPU seconds a process has used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ---- a client process (--client) --------------------------------------------------------------
def run_client(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    if args.client == "separate":  # its own nnsight + HF model, as a notebook without a server has
        import nnsight

        from nnrun.serve.client import _resolve_path

        model = nnsight.LanguageModel(_resolve_path(args.model), dispatch=True)
    else:
        import nnrun

        model = nnrun.LanguageModel(args.model, serve=args.client)
    one_trace(model, PROMPTS[0], 1)  # warm: connection, first forward
    Path(args.out + ".ready").touch()
    while not Path(args.start).exists():
        time.sleep(0.01)
    latencies, start, cpu_start = [], time.perf_counter(), _self_cpu_s()
    for i in range(args.traces):
        began = time.perf_counter()
        one_trace(model, PROMPTS[i % len(PROMPTS)], i % 4)
        latencies.append(time.perf_counter() - began)
    Path(args.out).write_text(
        json.dumps(
            {
                "latencies": latencies,
                "start": start,
                "end": time.perf_counter(),
                "wall_start": time.time() - (time.perf_counter() - start),
                "rss_mb": rss_mb(),
                "cpu_s": _self_cpu_s() - cpu_start,
            }
        )
    )


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---- the driver -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pin(pid: int, cpus: set[int] | None) -> None:
    """Run every thread of process `pid` on `cpus` (None: leave it as it is)."""
    if cpus is None:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def cpu_sets(args: argparse.Namespace) -> tuple[set[int] | None, set[int] | None]:
    """(the server's CPUs, the clients' CPUs) under --pin, else (None, None)."""
    cpus = sorted(ALL_CPUS)
    if not args.pin:
        return None, None
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least two CPUs")
    return {cpus[0]}, set(cpus[1:])


def requests_per_forward(before: dict, after: dict) -> float:
    """How many requests shared an engine forward on average between two `step_counters` snapshots."""
    forwards = after["forwards"] - before["forwards"]
    return (after["batched_requests"] - before["batched_requests"]) / forwards if forwards else 0.0


def run_processes(
    target: str, num_clients: int, args: argparse.Namespace, workdir: Path, counters: Callable[[], dict] | None = None
) -> dict:
    """N client processes against `target` (a server URL, or "separate"); their traces/s, latencies, RSS.

    `counters`: the server's step counters, read when the timed traces start and when they end.
    """
    start_file = workdir / f"start-{target.replace('/', '_')}-{num_clients}"
    outs = [workdir / f"out-{num_clients}-{i}-{abs(hash(target))}.json" for i in range(num_clients)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.client_threads))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--client",
                target,
                "--model",
                args.model,
                "--traces",
                str(args.traces),
                "--out",
                str(out),
                "--start",
                str(start_file),
            ],
            cwd=REPO,
            env=env,
        )
        for out in outs
    ]
    try:
        for proc in procs:
            pin(proc.pid, cpu_sets(args)[1])
        deadline = time.monotonic() + args.timeout
        while not all(Path(str(out) + ".ready").exists() for out in outs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("client processes did not get ready")
            time.sleep(0.05)
        rss = sum(rss_mb(p.pid) for p in procs)
        counted = counters() if counters else None
        began = time.time()
        start_file.touch()
        for proc in procs:
            proc.wait(timeout=args.timeout)
        results = [json.loads(out.read_text()) for out in outs]
        batching = {"requests_per_forward": requests_per_forward(counted, counters())} if counters else {}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    seconds = max(r["wall_start"] + r["end"] - r["start"] for r in results) - began
    latencies = sorted(x for r in results for x in r["latencies"])
    client_cpu_ms = sum(r["cpu_s"] for r in results) * 1000 / len(latencies)
    return summary(len(latencies), seconds, latencies) | {"rss_mb": rss, "client_cpu_ms": client_cpu_ms} | batching


def run_in_process(model, num_threads: int, args: argparse.Namespace) -> dict:
    latencies: list[float] = []
    lock = threading.Lock()

    def work() -> None:
        for i in range(args.traces):
            began = time.perf_counter()
            one_trace(model, PROMPTS[i % len(PROMPTS)], i % 4)
            with lock:
                latencies.append(time.perf_counter() - began)

    threads = [threading.Thread(target=work) for _ in range(num_threads)]
    counted = model.engine.step_counters()
    began, cpu_began = time.perf_counter(), _self_cpu_s()
    for thread in threads:
        thread.start()
    pin(os.getpid(), cpu_sets(args)[0])  # every thread of this process, the engine's included
    for thread in threads:
        thread.join()
    if args.pin:
        pin(os.getpid(), ALL_CPUS)  # back to every CPU: the next clients' set-up is not timed
    cpu_ms = (_self_cpu_s() - cpu_began) * 1000 / len(latencies)
    return summary(len(latencies), time.perf_counter() - began, sorted(latencies)) | {
        "cpu_ms": cpu_ms,
        "requests_per_forward": requests_per_forward(counted, model.engine.step_counters()),
    }


def summary(count: int, seconds: float, latencies: list[float]) -> dict:
    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return {
        "traces_per_s": count / seconds,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "mean_ms": statistics.mean(latencies) * 1000,
    }


def one_round(
    url: str, server: subprocess.Popen, local, num_clients: int, args: argparse.Namespace, workdir: Path
) -> tuple[dict, dict]:
    """N client processes against the server, then N threads in-process: (served, in-process) figures."""
    import httpx

    server_cpu = cpu_s(server.pid)
    served = run_processes(
        url, num_clients, args, workdir, counters=lambda: httpx.get(f"{url}/health", timeout=10).json()
    )
    # The server's CPU over the whole run (the clients' warm-up trace included: one each).
    served["server_cpu_ms"] = (cpu_s(server.pid) - server_cpu) * 1000 / (num_clients * (args.traces + 1))
    served["server_rss_mb"] = rss_mb(server.pid)
    return served, run_in_process(local, num_clients, args)


def print_round(num_clients: int, served: dict, inproc: dict) -> None:
    ratio = served["traces_per_s"] / inproc["traces_per_s"]
    print(
        f"{num_clients:>3} clients | served {served['traces_per_s']:7.1f} traces/s p50 "
        f"{served['p50_ms']:6.1f} ms p99 {served['p99_ms']:6.1f} ms | in-process (threads) "
        f"{inproc['traces_per_s']:7.1f} traces/s p50 {inproc['p50_ms']:6.1f} ms p99 "
        f"{inproc['p99_ms']:6.1f} ms | served/in-process {ratio:.2f}x"
    )
    print(
        f"{'':>3}         | CPU per trace: server {served['server_cpu_ms']:.1f} ms + client "
        f"{served['client_cpu_ms']:.1f} ms vs in-process {inproc['cpu_ms']:.1f} ms "
        f"({os.cpu_count()} cores here); requests per engine forward: served "
        f"{served['requests_per_forward']:.1f} vs in-process {inproc['requests_per_forward']:.1f}",
        flush=True,
    )


def print_separate(num_clients: int, served: dict, separate: dict) -> None:
    print(
        f"{'':>3}         | memory: server {served['server_rss_mb']:.0f} MB + clients "
        f"{served['rss_mb']:.0f} MB = {served['server_rss_mb'] + served['rss_mb']:.0f} MB vs "
        f"{num_clients} separate nnsight+HF processes {separate['rss_mb']:.0f} MB; separate "
        f"{separate['traces_per_s']:.1f} traces/s p50 {separate['p50_ms']:.1f} ms p99 "
        f"{separate['p99_ms']:.1f} ms ({separate['traces_per_s'] / served['traces_per_s']:.2f}x "
        f"served), CPU per trace {separate['client_cpu_ms']:.1f} ms",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-facts")
    parser.add_argument("--device", default="cpu", help="where the server and the in-process model run (clients: CPU)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--traces", type=int, default=50, help="traces per client")
    parser.add_argument("--separate", action="store_true", help="also N processes with their own nnsight+HF model")
    parser.add_argument("--client-threads", type=int, default=1, help="torch threads per client process")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="served and in-process runs alternated this many times per N; the median ratio is printed",
    )
    parser.add_argument("--pin", action="store_true", help="server and in-process run on CPU 0, clients on the rest")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        run_client(args)
        return

    import warnings

    import httpx

    import nnrun

    warnings.filterwarnings("ignore")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nnrun.cli",
            "serve",
            args.model,
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--max-in-flight",
            str(4 * max(args.clients)),
            "--device",
            args.device,
        ],
        cwd=REPO,
    )
    pin(server.pid, cpu_sets(args)[0])  # before it starts its threads: they inherit it
    local = nnrun.LanguageModel(args.model, device=args.device)
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("nnrun serve did not start")
            time.sleep(0.2)
        run_in_process(local, 1, args)  # warm-up
        weights_mb = sum(p.numel() * p.element_size() for p in local.engine.model.parameters()) / 2**20
        print(
            f"model {args.model} ({weights_mb:.0f} MB of weights); {args.traces} traces per client; one prompt "
            "each, one layer's last position saved"
        )
        with tempfile.TemporaryDirectory() as workdir:
            for num_clients in args.clients:
                ratios = []
                for round_index in range(args.rounds):
                    round_dir = Path(workdir) / f"{num_clients}-{round_index}"  # its own start and ready files
                    round_dir.mkdir()
                    served, inproc = one_round(url, server, local, num_clients, args, round_dir)
                    ratios.append(served["traces_per_s"] / inproc["traces_per_s"])
                    print_round(num_clients, served, inproc)
                    if args.separate:
                        print_separate(num_clients, served, run_processes("separate", num_clients, args, round_dir))
                if args.rounds > 1:
                    print(
                        f"{num_clients:>3} clients | served/in-process over {args.rounds} alternated rounds: median "
                        f"{statistics.median(ratios):.2f}x (each: {', '.join(f'{r:.2f}' for r in ratios)})"
                    )
    finally:
        local.shutdown()
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
