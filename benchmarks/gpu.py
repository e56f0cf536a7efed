"""GPU throughput of the engine against plain HF transformers, dummy weights in real Llama shapes.

Shapes: `1b` (Llama-3.2-1B), `8b` (Llama-3-8B), `tiny` (a CPU smoke test). One markdown table per section:

  prefill  B prompts of --prompt-len tokens: nnrun `generate(max_tokens=1, temperature=0)` vs HF
           padded batches (`logits_to_keep=1`, no cache). Prompt tokens/s; MFU of nnrun.
  decode   B prompts of --decode-prompt-len tokens, N = --new-tokens greedy tokens each (EOS ignored):
           nnrun `generate` vs HF `generate`. Decode tok/s = B*(N-1) / (T(N) - T(1)), T(n) being a
           whole call with n new tokens, so prefill and the first token are left out. MBU of nnrun.
  profile  what a decode step's time is made of, per batch: torch.profiler over `generate` of 1 and of
           --profile-tokens tokens, the difference divided by the steps between: wall time (profiled),
           the GPU's busy time (kernels and copies, overlaps merged), the idle share, kernel and graph
           launches, and the kernels that take the most time. Then one prefill call of B prompts of
           --prompt-len tokens (max_tokens=1), whole.
  extract  M prompts of 16..--prompt-len tokens: `nnrun.extract` of the middle layer (shards on disk)
           vs HF padded batches + a forward hook copying each prompt's rows to the host (HF runs the
           whole model; extraction stops after the layer). Prompt tokens/s.
  interventions  --gen-prompts prompts of 64..192 tokens x --gen-tokens greedy tokens, one invoke per
           prompt (issue 35's rows, benchmarks/generation_rows.py): the engine alone, traces with
           nothing inside / one layer / its last row / every layer saved every step / a steering
           vector, HF `generate`, nnsight on HF. Seconds, ratio to the engine, nnsight on HF's time
           over ours, microseconds per saved value. Only when named (`--only interventions`), and
           last: it shuts the plain engine down and builds nnrun's LanguageModel over the same
           weights (its engine is the "engine alone" row). With --profile-rows, what a decode step of
           the engine alone, the empty trace, one layer saved and steering is made of: as `profile`
           (the GPU's busy and idle time, launches, host waits), and the engine thread's own sections
           (the model call, its decoder-layer pieces, the handoffs to blocks with the blocks' time,
           sampling, the end of a watched step: the saved values' copies).

The engine is given the HF module itself, so one copy of the weights serves both; HF baselines
switch its attention to stock sdpa and back. Every contender first runs untimed on the same shapes
(FlashInfer compiles its kernels on first use); timings are wall clock, CUDA synchronized, best of
--repeats. Ratios are nnrun / HF. Run one section per command on a GPU, e.g.

    python benchmarks/gpu.py --shape 8b --only decode --out decode-8b.json
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gc
import json
import math
import platform
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import generation_rows
import torch
import transformers
from common import (
    StepTimer,
    decode_step_bytes,
    device_peaks,
    left_padded,
    prefill_flops,
    random_prompts,
    shape_config,
)
from transformers import AutoModelForCausalLM

import nnrun
from nnrun.config import resolve_dtype

SECTIONS = ("prefill", "decode", "profile", "extract", "interventions")
DEFAULT_SECTIONS = ("prefill", "decode", "extract")  # interventions replaces the engine: asked for by name
GPU_DEFAULTS = {
    "batches": "1,16,64,256",
    "prompt_len": 512,
    "decode_prompt_len": 128,
    "new_tokens": 128,
    "extract_prompts": 10000,
    "gen_prompts": 32,
    "gen_tokens": 32,
    "gen_prompt_lens": (64, 192),
}
CPU_DEFAULTS = {
    "batches": "1,4",
    "prompt_len": 64,
    "decode_prompt_len": 16,
    "new_tokens": 8,
    "extract_prompts": 64,
    "gen_prompts": 4,
    "gen_tokens": 4,
    "gen_prompt_lens": (8, 24),
}
TABLE_COLUMNS = {
    "prefill": ("batch", "prompt tok/s", "MFU"),
    "decode": ("batch", "decode tok/s", "MBU"),
    "extract": ("prompts", "prompt tok/s", None),
}  # (first column, unit, nnrun's utilization)


def best_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best wall time of `repeats` calls; the caller has warmed `run`'s shapes up already."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    best = math.inf
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


@contextmanager
def stock_sdpa(model: torch.nn.Module) -> Iterator[None]:
    """Run HF baselines on plain sdpa, then give the engine its own attention back."""
    engine_attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(engine_attention)


def in_chunks(prompts: list[list[int]], size: int) -> Iterator[list[list[int]]]:
    return (prompts[first : first + size] for first in range(0, len(prompts), size))


@torch.no_grad()
def hf_prefill(model: torch.nn.Module, prompts: list[list[int]], chunk: int) -> None:
    for batch in in_chunks(prompts, chunk):
        ids, mask = left_padded(batch)
        model(ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False, logits_to_keep=1)


@torch.no_grad()
def hf_generate(model: torch.nn.Module, prompts: list[list[int]], chunk: int, new_tokens: int) -> None:
    for batch in in_chunks(prompts, chunk):
        ids, mask = left_padded(batch)
        model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )


@torch.no_grad()
def hf_extract(model: torch.nn.Module, prompts: list[list[int]], module: str, chunk: int) -> None:
    """Padded batches; a forward hook copies each prompt's own rows of `module`'s output to the host."""
    lengths: list[int] = []

    def copy_rows(mod: torch.nn.Module, args: tuple, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # [B, T_max, H]
        for row, n in enumerate(lengths):
            hidden[row, hidden.shape[1] - n :].to("cpu", copy=True)

    handle = model.get_submodule(module).register_forward_hook(copy_rows)
    try:
        for batch in in_chunks(prompts, chunk):
            lengths[:] = map(len, batch)
            ids, mask = left_padded(batch)
            model(ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()


def nnrun_extract(llm: nnrun.LLM, prompts: list[list[int]], module: str) -> None:
    out_dir = tempfile.mkdtemp(prefix="nnrun-gpu-bench-")
    try:
        nnrun.extract(llm, prompts, [module], out_dir, progress=False)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def run_prefill(llm: nnrun.LLM, args: argparse.Namespace, peaks: tuple[float, float] | None) -> list[dict]:
    rows = []
    for batch in args.batches:
        prompts = random_prompts(batch, args.prompt_len, args.prompt_len, llm.vocab_size, seed=batch)
        llm.generate(prompts, nnrun.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
        once = nnrun.SamplingParams(max_tokens=1, temperature=0)
        seconds = best_seconds(lambda: llm.generate(prompts, once), args.device, args.repeats)
        hf_seconds = None
        if not args.skip_hf:
            with stock_sdpa(llm.model):
                hf_prefill(llm.model, prompts, args.hf_max_batch)  # warm-up
                hf_seconds = best_seconds(
                    lambda: hf_prefill(llm.model, prompts, args.hf_max_batch), args.device, args.repeats
                )
        flops = prefill_flops(llm.model.config, [len(p) for p in prompts])
        rows.append(
            result_row(
                batch, batch * args.prompt_len, seconds, hf_seconds, flops / seconds / peaks[0] if peaks else None
            )
        )
    return rows


def decode_params(args: argparse.Namespace, max_tokens: int) -> nnrun.SamplingParams:
    """The decode rows' sampling: greedy, or `--temperature`/`--top-k` sampling (HF's rows stay greedy)."""
    return nnrun.SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k, ignore_eos=True)


def decode_seconds(generate: Callable[[int], object], device: torch.device, repeats: int, new_tokens: int) -> float:
    """T(N) - T(1) for `generate(n)` making n new tokens: N-1 decode steps, without prefill and first token."""
    first = best_seconds(lambda: generate(1), device, repeats)
    return best_seconds(lambda: generate(new_tokens), device, repeats) - first


def run_decode(llm: nnrun.LLM, args: argparse.Namespace, peaks: tuple[float, float] | None) -> list[dict]:
    rows, n = [], args.new_tokens
    for batch in args.batches:
        prompts = random_prompts(batch, args.decode_prompt_len, args.decode_prompt_len, llm.vocab_size, seed=batch)

        def nnrun_generate(k: int) -> None:
            llm.generate(prompts, decode_params(args, k))

        def hf_generate_all(k: int) -> None:
            hf_generate(llm.model, prompts, args.hf_max_batch, k)

        nnrun_generate(2)  # warm-up: this batch's prefill and decode shapes
        seconds = decode_seconds(nnrun_generate, args.device, args.repeats, n)
        hf_seconds = None
        if not args.skip_hf:
            with stock_sdpa(llm.model):
                hf_generate_all(2)  # warm-up
                hf_seconds = decode_seconds(hf_generate_all, args.device, args.repeats, n)
        context_len = args.decode_prompt_len + n / 2  # the mean over the N-1 timed steps
        step_bytes = decode_step_bytes(llm.model.config, llm.model.dtype.itemsize, batch, context_len)
        mbu = step_bytes * (n - 1) / seconds / peaks[1] if peaks else None
        rows.append(result_row(batch, batch * (n - 1), seconds, hf_seconds, mbu))
    return rows


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of `intervals` (kernels on several streams may overlap)."""
    busy, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


# CUDA runtime calls that block the host until the GPU has caught up: a step that makes one leaves the GPU
# idle while the host then prepares the next.
HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def profile_generate(run: Callable[[], object], device: torch.device) -> dict:
    """One profiled call of `run`: wall µs, GPU busy µs, kernel and graph launches, µs per kernel name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    on_device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    per_kernel: dict[str, float] = {}
    for event in on_device:
        per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.time_range.elapsed_us()
    host_names = [e.name for e in prof.events() if e.device_type == DeviceType.CPU]
    return {
        "wall_us": wall_us,
        "busy_us": _busy_us([(e.time_range.start, e.time_range.end) for e in on_device]),
        "kernels": len(on_device),
        "kernel_launches": sum(name in ("cudaLaunchKernel", "cudaLaunchKernelExC") for name in host_names),
        "graph_launches": sum(name == "cudaGraphLaunch" for name in host_names),
        "host_waits": sum(name in HOST_WAITS for name in host_names),
        "per_kernel_us": per_kernel,
    }


def per_decode_step(one: dict, many: dict, keys: Iterable[str], steps: int) -> dict[str, float]:
    """(a call's figure with all its new tokens - the one-token call's) / the decode steps between, per key
    (a key one call lacks counts 0 there)."""
    return {key: (many.get(key, 0.0) - one.get(key, 0.0)) / steps for key in keys}


def run_profile(llm: nnrun.LLM, args: argparse.Namespace, peaks: tuple[float, float] | None) -> list[dict]:
    """Per decode step: (profile of N tokens - profile of 1 token) / (N - 1), per batch."""
    rows, n = [], args.profile_tokens
    for batch in args.batches:
        prompts = random_prompts(batch, args.decode_prompt_len, args.decode_prompt_len, llm.vocab_size, seed=batch)

        def generate(k: int) -> Callable[[], object]:
            params = decode_params(args, k)
            return lambda: llm.generate(prompts, params)

        generate(2)()  # warm-up
        one, many = profile_generate(generate(1), args.device), profile_generate(generate(n), args.device)
        counted = ("wall_us", "busy_us", "kernels", "kernel_launches", "graph_launches", "host_waits")
        per_step = per_decode_step(one, many, counted, n - 1)
        kernels = per_decode_step(one["per_kernel_us"], many["per_kernel_us"], many["per_kernel_us"], n - 1)
        top = sorted(kernels.items(), key=lambda item: -item[1])[:6]
        rows.append({"kind": "decode", "size": batch, **per_step, "top_kernels_us": top})
    for batch in args.batches:  # a prefill call: its one step, sampling and bookkeeping included
        prompts = random_prompts(batch, args.prompt_len, args.prompt_len, llm.vocab_size, seed=batch)
        params = nnrun.SamplingParams(max_tokens=1, temperature=0)
        llm.generate(prompts, params)  # warm-up
        call = profile_generate(lambda: llm.generate(prompts, params), args.device)
        top = sorted(call.pop("per_kernel_us").items(), key=lambda item: -item[1])[:6]
        rows.append({"kind": f"prefill {args.prompt_len}", "size": batch, **call, "top_kernels_us": top})
    return rows


def print_profile(rows: list[dict]) -> None:
    print(
        "\n## profile (per decode step; per prefill call)\n\n| step | batch | wall ms (profiled) | GPU busy ms | "
        "GPU idle | kernels | kernel launches | graph launches | host waits |\n|---|---|---|---|---|---|---|---|---|"
    )
    for row in rows:
        idle = 1 - row["busy_us"] / row["wall_us"] if row["wall_us"] > 0 else float("nan")
        print(
            f"| {row['kind']} | {row['size']} | {row['wall_us'] / 1e3:.2f} | {row['busy_us'] / 1e3:.2f} | {idle:.0%} | "
            f"{row['kernels']:.0f} | {row['kernel_launches']:.0f} | {row['graph_launches']:.1f} | {row['host_waits']:.2f} |"
        )
    for row in rows:
        top = "; ".join(f"{name[:60]} {us:.0f} us" for name, us in row["top_kernels_us"])
        print(f"{row['kind']}, batch {row['size']}, top kernels: {top or 'none recorded (no CUDA)'}")


def run_extract(llm: nnrun.LLM, args: argparse.Namespace, peaks: tuple[float, float] | None) -> list[dict]:
    module = f"model.layers.{llm.model.config.num_hidden_layers // 2}"
    prompts = random_prompts(args.extract_prompts, min(16, args.prompt_len), args.prompt_len, llm.vocab_size)
    nnrun_extract(llm, prompts[:64], module)  # warm-up
    seconds = best_seconds(lambda: nnrun_extract(llm, prompts, module), args.device, args.repeats)
    hf_seconds = None
    if not args.skip_hf:
        with stock_sdpa(llm.model):
            hf_extract(llm.model, prompts[: args.hf_extract_batch], module, args.hf_extract_batch)  # warm-up
            hf_seconds = best_seconds(
                lambda: hf_extract(llm.model, prompts, module, args.hf_extract_batch), args.device, args.repeats
            )
    print(
        f"extract: {module} of {llm.model.config.num_hidden_layers} layers to disk; HF: padded batches of "
        f"{args.hf_extract_batch}, whole model"
    )
    return [result_row(len(prompts), sum(map(len, prompts)), seconds, hf_seconds, None)]


def run_interventions(llm: nnrun.LLM, args: argparse.Namespace, peaks: tuple[float, float] | None) -> list[dict]:
    """Issue 35's rows on the engine's own weights: nnrun's LanguageModel replaces the plain engine."""
    import nnsight

    model = llm.model
    llm.shutdown()  # its KV pool makes room for the LanguageModel's engine
    gc.collect()
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    config = model.config
    tokenizer = generation_rows.word_tokenizer(config.vocab_size)
    low, high = args.gen_prompt_lens
    prompt_ids = random_prompts(args.gen_prompts, low, high, config.vocab_size, seed=35)
    setup = generation_rows.GenerationSetup.for_model(
        config, prompt_ids, args.gen_tokens, device=args.device, dtype=model.dtype
    )
    ours = nnrun.LanguageModel(
        model,
        tokenizer=tokenizer,
        device=str(args.device),
        dtype=model.dtype,
        max_num_seqs=max(args.gen_prompts, max(args.batches)),
        max_num_batched_tokens=args.batch_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_cuda_graphs=args.cuda_graphs,
        attention_backend=args.attention_backend,
        **engine_options(args),
    )
    # nnsight on HF wraps the same modules (each wrapper routes to its own trace); HF runs on stock sdpa.
    oracle = None if args.skip_hf else nnsight.LanguageModel(model, tokenizer=tokenizer)
    rows = generation_rows.workloads(ours, oracle, None if args.skip_hf else model, setup)
    hf_rows = {name for name in rows if name.startswith(("HF", "nnsight on HF"))}
    for name in hf_rows:
        rows[name] = _on_stock_sdpa(model, rows[name])
    sync = (lambda: torch.cuda.synchronize(args.device)) if args.device.type == "cuda" else (lambda: None)
    graphs = getattr(ours.engine.runner, "graph_runner", None)
    print(
        f"interventions: {args.gen_prompts} prompts of {low}..{high} tokens x {args.gen_tokens} new tokens, greedy; "
        f"decode graphs for batch sizes {graphs.batch_sizes if graphs else 'none'}; best of {args.repeats}"
    )
    with warnings.catch_warnings():  # nnsight warns that each open `tracer.all()` loop outran the generation
        warnings.simplefilter("ignore")
        seconds = generation_rows.best_times(rows, max(args.repeats, 1), sync=sync)
        profiles = profile_rows(ours, setup, args.device) if args.profile_rows else {}
    ours.shutdown()
    report = generation_rows.report(seconds, setup)
    for row in report:
        row["profile"] = profiles.get(row["workload"])
    return report


# The rows `--profile-rows` takes apart: the engine alone and the traced rows that watch one layer or none
PROFILED_ROWS = (
    "engine.generate",
    "traced, nothing inside",
    "one layer saved every step",
    "steering vector every step",
)
HOST_SECTIONS = ("step", "model", "pieces", "handoffs", "sample", "end of step")


def profile_rows(ours: object, setup: generation_rows.GenerationSetup, device: torch.device) -> dict[str, dict]:
    """Per decode step of each of `PROFILED_ROWS`, as `run_profile` takes a decode step: (a call of all the new
    tokens - a call of one) / (new tokens - 1). From profiled calls: wall, GPU busy, launches, host waits; from
    unprofiled ones, the engine thread's wall time in `HOST_SECTIONS` (`handoffs`: every visit of a watched
    location, the blocks it wakes included; `end of step`: the saved values' copies and budget)."""
    from interleaver.mediator import PackedInterleaver
    from interleaver.requests import NNsightRequestHelper
    from nnrun.graph_pieces import DecoderLayerPieces

    llm = ours.engine
    timer = StepTimer(llm)
    wrapped = {
        (PackedInterleaver, "handle"): "handoffs",
        (DecoderLayerPieces, "call"): "pieces",
        (NNsightRequestHelper, "end_step"): "end of step",
    }
    originals = {key: key[0].__dict__[key[1]] for key in wrapped}
    for (owner, method), section in wrapped.items():
        timer.wrap(owner, method, section)
    setups = {1: dataclasses.replace(setup, new_tokens=1), setup.new_tokens: setup}
    thunks = {tokens: generation_rows.workloads(ours, None, None, s) for tokens, s in setups.items()}
    steps = setup.new_tokens - 1
    profiles = {}
    try:
        for name in PROFILED_ROWS:
            profiled, host = {}, {}
            for tokens, rows in thunks.items():
                rows[name]()  # warm-up
                with timer.measuring():
                    rows[name]()
                    host[tokens] = {section: 1e6 * seconds for section, seconds in timer.seconds.items()}
                profiled[tokens] = profile_generate(rows[name], device)
            one, many = profiled[1], profiled[setup.new_tokens]
            counted = ("wall_us", "busy_us", "kernel_launches", "graph_launches", "host_waits")
            profiles[name] = per_decode_step(one, many, counted, steps)
            profiles[name]["host_us"] = per_decode_step(host[1], host[setup.new_tokens], HOST_SECTIONS, steps)
            # the whole call of all the new tokens, unsubtracted (the JSON report's: a difference may be noise)
            whole = host[setup.new_tokens]
            profiles[name]["call_us"] = {section: whole.get(section, 0.0) for section in HOST_SECTIONS}
            profiles[name]["call_us"]["wall"] = many["wall_us"]
    finally:
        for (owner, method), original in originals.items():
            setattr(owner, method, original)
    return profiles


def print_row_profiles(rows: list[dict]) -> None:
    """`--profile-rows`' table: per decode step, the profile and the engine thread's sections."""
    rows = [row for row in rows if row.get("profile")]
    if not rows:
        return
    print(
        "\n## interventions: per decode step (profiled: wall, GPU; unprofiled: the engine thread's sections, ms)\n\n"
        "| workload | wall ms | GPU busy ms | GPU idle | kernel launches | graph launches | host waits | "
        + " | ".join(HOST_SECTIONS)
        + " |\n|"
        + "---|" * (7 + len(HOST_SECTIONS))
    )
    for row in rows:
        p = row["profile"]
        idle = 1 - p["busy_us"] / p["wall_us"] if p["wall_us"] > 0 else float("nan")
        host = " | ".join(f"{p['host_us'][section] / 1e3:.2f}" for section in HOST_SECTIONS)
        print(
            f"| {row['workload']} | {p['wall_us'] / 1e3:.2f} | {p['busy_us'] / 1e3:.2f} | {idle:.0%} | "
            f"{p['kernel_launches']:.0f} | {p['graph_launches']:.1f} | {p['host_waits']:.2f} | {host} |"
        )


def _on_stock_sdpa(model: torch.nn.Module, run: Callable[[], object]) -> Callable[[], object]:
    def on_sdpa() -> object:
        with stock_sdpa(model):
            return run()

    return on_sdpa


def result_row(size: int, tokens: int, seconds: float, hf_seconds: float | None, utilization: float | None) -> dict:
    """One table row: nnrun and HF tokens/s over the same `tokens`, their ratio, nnrun's MFU or MBU."""
    row = {
        "size": size,
        "tokens": tokens,
        "nnrun_tok_s": tokens / seconds,
        "hf_tok_s": None,
        "ratio": None,
        "utilization": utilization,
    }
    if hf_seconds is not None:
        row["hf_tok_s"] = tokens / hf_seconds
        row["ratio"] = hf_seconds / seconds
    return row


def print_table(section: str, rows: list[dict]) -> None:
    if section == "interventions":
        generation_rows.print_report(rows, heading=section)
        print_row_profiles(rows)
        return
    if section == "profile":
        print_profile(rows)
        return
    size, unit, metric = TABLE_COLUMNS[section]
    header = [size, "tokens", f"nnrun {unit}", f"HF {unit}", "ratio"] + ([metric] if metric else [])
    print(f"\n## {section}\n\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        cells = [
            str(row["size"]),
            str(row["tokens"]),
            f"{row['nnrun_tok_s']:.0f}",
            "-" if row["hf_tok_s"] is None else f"{row['hf_tok_s']:.0f}",
            "-" if row["ratio"] is None else f"{row['ratio']:.2f}x",
        ]
        if metric:
            cells.append("n/a" if row["utilization"] is None else f"{row['utilization']:.1%}")
        print("| " + " | ".join(cells) + " |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "1b", "8b"), default="1b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batches", default=None, help="comma list (default 1,16,64,256 on CUDA)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prefill prompt length; longest extract prompt")
    parser.add_argument("--decode-prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None, help="decode tokens per prompt (>= 2)")
    parser.add_argument("--extract-prompts", type=int, default=None)
    parser.add_argument("--profile-tokens", type=int, default=16, help="profile: new tokens of the profiled call")
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        help="prefill, decode, profile, extract, interventions (repeat or comma list)",
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0, help="decode and profile: sample (HF stays greedy)")
    parser.add_argument("--top-k", type=int, default=0, help="decode and profile: top-k with --temperature")
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an engine option for nnrun's engines, e.g. num_scheduler_steps=4 or cuda_graph_pieces=true (repeat)",
    )
    parser.add_argument("--hf-max-batch", type=int, default=256, help="prompts per HF call in prefill and decode")
    parser.add_argument("--hf-extract-batch", type=int, default=32, help="prompts per HF padded batch in extract")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="engine max_num_batched_tokens")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="share of the GPU the engine may fill (vLLM's meaning); the rest is the HF baselines'",
    )
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "flashinfer"))
    parser.add_argument("--enable-cuda-graphs", dest="cuda_graphs", action="store_true", default=True)
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per measurement; the best counts")
    parser.add_argument("--out", default=None, help="also write the results to this JSON file")
    parser.add_argument("--gen-prompts", type=int, default=None, help="interventions: prompts (one invoke each)")
    parser.add_argument("--gen-tokens", type=int, default=None, help="interventions: new tokens per prompt")
    parser.add_argument(
        "--profile-rows",
        action="store_true",
        help="interventions: also take apart a decode step of the engine alone, the empty trace, one layer, steering",
    )
    parser.set_defaults(gen_prompt_lens=None)  # interventions: (shortest, longest) prompt, from the defaults
    args = parser.parse_args()
    defaults = GPU_DEFAULTS if args.device.startswith("cuda") else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.only = [s for item in (args.only or DEFAULT_SECTIONS) for s in item.split(",") if s]
    if unknown := set(args.only) - set(SECTIONS):
        parser.error(f"--only takes {', '.join(SECTIONS)}; got {', '.join(sorted(unknown))}")
    # interventions shuts the plain engine down: it runs last
    args.only = sorted(args.only, key=lambda section: section == "interventions")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode time is T(N) - T(1))")
    args.device = torch.device(args.device)
    return args


def engine_options(args: argparse.Namespace) -> dict:
    """`--engine-option NAME=VALUE` pairs, values read as Python literals (`true`/`false` as booleans)."""
    options = {}
    for pair in args.engine_option:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-option takes NAME=VALUE, got {pair!r}")
        text = {"true": "True", "false": "False"}.get(text.lower(), text)
        try:
            options[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[name] = text
    return options


def build_engine(args: argparse.Namespace) -> nnrun.LLM:
    """Random weights built on the device itself (an 8B model in fp32 on the host would take minutes)."""
    dtype = resolve_dtype(args.dtype, str(args.device))
    torch.manual_seed(0)
    with args.device:
        model = AutoModelForCausalLM.from_config(shape_config(args.shape), attn_implementation="sdpa", dtype=dtype)
    return nnrun.LLM(
        model.eval(),
        device=str(args.device),
        dtype=dtype,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=args.batch_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_cuda_graphs=args.cuda_graphs,
        attention_backend=args.attention_backend,
        **engine_options(args),
    )


def describe_machine(llm: nnrun.LLM, args: argparse.Namespace) -> dict:
    """Device, versions and the engine's choices, printed and kept in the JSON report."""
    is_cuda = args.device.type == "cuda"
    device_name = torch.cuda.get_device_name(args.device) if is_cuda else f"cpu ({platform.machine()})"
    params = sum(p.numel() for p in llm.model.parameters())
    graphs = getattr(llm.runner, "graph_runner", None)
    exact = llm.runner.exact_forward
    machine = {
        "device": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention_backend": llm.runner.attn_backend.name,
        # the exact path's figures are HF's own forward per request, not the packed engine's
        "forward_path": "packed" if exact is None else f"exact ({exact.reason})",
        "cuda_graphs_requested": args.cuda_graphs,
        "cuda_graph_batch_sizes": graphs.batch_sizes if graphs is not None else None,
        "dtype": str(llm.model.dtype),
        "params": params,
        "kv_pool_tokens": llm.runner.max_total_tokens,
        "command": "python " + shlex.join(sys.argv),
    }
    print(
        f"device: {device_name}; torch {torch.__version__}; transformers {transformers.__version__}; "
        f"attention backend {machine['attention_backend']}; decode CUDA graphs captured for batch sizes "
        f"{machine['cuda_graph_batch_sizes'] or 'none'} (requested: {args.cuda_graphs})"
    )
    print(
        f"model: dummy Llama {args.shape}, {params / 1e6:.1f}M params, {llm.model.dtype}; "
        f"KV pool {machine['kv_pool_tokens']} tokens"
    )
    print(f"command: {machine['command']}")
    if exact is not None:
        print(
            f"WARNING: the engine runs this model on the exact path, so these are not the packed engine's figures: {exact.reason}"
        )
    return machine


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # a run killed at its time limit still shows finished tables
    args = parse_args()
    start = time.perf_counter()
    llm = build_engine(args)
    report = {"machine": describe_machine(llm, args), "sections": {}, "elapsed_s": {}}
    is_half = llm.model.dtype in (torch.bfloat16, torch.float16)
    peaks = device_peaks(report["machine"]["device"]) if args.device.type == "cuda" and is_half else None
    print(
        f"peaks (FLOP/s, bytes/s): {peaks or 'n/a'}; engine built in {time.perf_counter() - start:.1f} s "
        "(KV sizing and graph capture run steps: FlashInfer may compile here)"
    )
    runners = {
        "prefill": run_prefill,
        "decode": run_decode,
        "profile": run_profile,
        "extract": run_extract,
        "interventions": run_interventions,
    }
    for section in args.only:
        start = time.perf_counter()
        report["sections"][section] = runners[section](llm, args, peaks)
        report["elapsed_s"][section] = time.perf_counter() - start
        print_table(section, report["sections"][section])
        print(f"\n{section} took {report['elapsed_s'][section]:.1f} s (warm-ups included)")
        if args.out:  # after every section, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        gc.collect()
        if args.device.type == "cuda":
            torch.cuda.empty_cache()  # HF's activations of this section must not crowd the next one
    llm.shutdown()


if __name__ == "__main__":
    main()
