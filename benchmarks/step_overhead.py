"""The engine's fixed cost per step, apart from the model's math, against HF `generate`'s.

Each engine step is split into sections by timing the methods that run them: schedule, prepare
(the ForwardBatch), plan (the attention backend's per-step metadata), model (HF's forward,
attention calls included; attention shown apart), sample, and bookkeeping (the rest of the
step: stop checks, outputs, finishing requests). The same greedy workload runs on the real small
Llama and on a cheap one (one layer, hidden 32), whose math is next to nothing: on the cheap one a
step's time is almost all fixed cost, and HF `generate`'s time per step there is its own fixed
cost, the floor nnrun has to match. Ratios are of interleaved runs in one process.

Decode steps replay the CPU's traced graphs (nnrun/traced_graph.py) once their batch size is captured, as a
user's engine does; `model` is then the replay (attention shown apart is its eager calls).

First, issue 36's decode table: the tiny Llama (hidden 64, 2 layers, vocab 256, `common.shape_config`),
prompts of 8 tokens, greedy, at batch 1, 64 and 256. A decode step's time is
(T(17 tokens) - T(1)) / 16, best of 3, for nnrun and for HF `generate` on the same model in the
same run; the engine's host sections are shown per step and per request (a section whose time
per request does not fall with the batch is per-request Python).

Then the multi-step table: the same decode step with k decode steps per scheduling decision
(`num_scheduler_steps`, k = 1, 2, 4, 8), from which the CPU default was chosen.

And the aten-op table: the ATen ops one decoder layer dispatches (kernels, which an accelerator launches
one each, and views, which cost the host only) in nnrun's forward on the torch backend and in HF's own
forward with its DynamicCache, for a prefill and for a decode step of the tiny Llama; ops outside the
layers are counted per step (nnrun's: its attention plan too). A count, not a time: it holds on any machine.

Usage: python benchmarks/step_overhead.py [--batches 1 64 256] [--prompts 16] [--new-tokens 32] [--reps 5]
       [--decode-only | --multi-step-only | --ops-only] [--window-sizes 1 2 4 8] [--ops-prompt-len 64]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from typing import Callable

import torch
from common import StepTimer, interleaved_times, left_padded, shape_config
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import nnrun

SECTIONS = ("schedule", "prepare", "plan", "model", "attention", "sample", "bookkeeping")


def llama(hidden: int, layers: int, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def measure(name: str, model: LlamaForCausalLM, args: argparse.Namespace) -> None:
    import copy

    hf = copy.deepcopy(model)
    llm = nnrun.LLM(model)
    timer = StepTimer(llm)
    prompts = [
        [(7 * i + 3 * j) % (model.config.vocab_size - 2) + 2 for j in range(8 + (i * 7) % 25)]
        for i in range(args.prompts)
    ]
    params = nnrun.SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    ids, mask = left_padded(prompts)

    def hf_generate() -> None:
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    def engine_generate() -> None:
        llm.generate(prompts, params)

    hf_generate()
    engine_generate()
    with timer.measuring():  # only the engine's runs reach the timer
        hf_time, our_time = interleaved_times(hf_generate, engine_generate, args.reps)
    per_step = timer.per_step_ms()
    wall_ms = 1e3 * our_time / (timer.num_steps / args.reps)
    fixed = per_step["schedule"] + per_step["prepare"] + per_step["plan"] + per_step["sample"] + per_step["bookkeeping"]
    print(
        f"\n{name}: {args.prompts} prompts x {args.new_tokens} greedy tokens; HF generate {1e3 * hf_time:.1f} ms, "
        f"nnrun {1e3 * our_time:.1f} ms, speedup {hf_time / our_time:.2f}x"
    )
    print(
        f"  per step: HF generate {1e3 * hf_time / args.new_tokens:.2f} ms | nnrun {wall_ms:.2f} ms wall (median run), "
        f"engine step {per_step['step']:.2f} ms (mean over all runs)"
    )
    for section in SECTIONS:
        share = per_step[section] / per_step["step"]
        note = " (inside model)" if section == "attention" else ""
        print(f"    {section:12s} {per_step[section]:7.3f} ms  {share:6.1%}{note}")
    print(
        f"    fixed cost (schedule+prepare+plan+sample+bookkeeping) {fixed:.3f} ms = {fixed / per_step['step']:.1%} "
        f"of the step"
    )
    llm.shutdown()


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


DECODE_TOKENS = 17  # a step is (T(17) - T(1)) / 16


HOST_SECTIONS = ("schedule", "prepare", "plan", "sample")


def measure_decode(batches: list[int], repeats: int) -> None:
    """Issue 36's CPU table: decode step of nnrun and HF `generate` on the tiny Llama, with nnrun's host sections.

    Step times are wall clock, (best T(17) - best T(1)) / 16. The same difference in CPU time (the
    engine thread's for nnrun, the calling thread's for HF) is printed beside them: on a shared
    machine it is the steadier figure. The host sections are the engine thread's CPU time per decode
    step (the prefill step's taken out), best of the same runs: host is the step less the model's
    forward (planning counts as host), bookkeeping the step less the rest.
    """
    import copy

    torch.manual_seed(0)
    model = LlamaForCausalLM(shape_config("tiny")).eval()
    model.generation_config.eos_token_id = None
    hf = copy.deepcopy(model)
    llm = nnrun.LLM(model, max_num_seqs=max(batches), max_total_tokens=max(batches) * 32)
    timer = StepTimer(llm, time.thread_time)
    timer.wrap(llm, "_publish", "publish")  # the engine loop's per-step work outside the core's step
    print(f"\ntiny Llama (hidden 64, 2 layers, vocab 256), 8-token prompts, greedy; best of {repeats}")
    print(
        f"{'batch':>6} {'nnrun step':>11} {'HF step':>9} {'HF/nnrun':>9} {'vs batch 1':>10} | {'CPU: nnrun':>10} "
        f"{'HF':>7} {'HF/nnrun':>8} {'vs batch 1':>10} | {'host':>7} {'per req':>9}  host sections per step (ms)"
    )
    first_step = first_cpu = None
    steps = DECODE_TOKENS - 1
    for batch in batches:
        prompts = [[(7 * i + 3 * j) % 254 + 2 for j in range(8)] for i in range(batch)]
        ids, mask = left_padded(prompts)

        def ours(k: int) -> dict[str, float]:
            with timer.measuring():
                llm.generate(prompts, nnrun.SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
                return dict(timer.seconds)

        def theirs(k: int) -> float:
            start = time.thread_time()
            with torch.no_grad():
                hf.generate(
                    ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0
                )
            return time.thread_time() - start

        ours(2), theirs(2)  # warm-up
        our_times: dict[int, list[float]] = {1: [], DECODE_TOKENS: []}
        sections: dict[int, list[dict[str, float]]] = {1: [], DECODE_TOKENS: []}
        for _ in range(repeats):
            for k in (1, DECODE_TOKENS):
                start = time.perf_counter()
                sections[k].append(ours(k))
                our_times[k].append(time.perf_counter() - start)
        hf_times: dict[int, list[float]] = {1: [], DECODE_TOKENS: []}
        hf_cpu: dict[int, list[float]] = {1: [], DECODE_TOKENS: []}
        for _ in range(repeats):
            for k in (1, DECODE_TOKENS):
                start = time.perf_counter()
                hf_cpu[k].append(theirs(k))
                hf_times[k].append(time.perf_counter() - start)
        our_step = (min(our_times[DECODE_TOKENS]) - min(our_times[1])) / steps
        hf_step = (min(hf_times[DECODE_TOKENS]) - min(hf_times[1])) / steps
        hf_cpu_step = 1e3 * (min(hf_cpu[DECODE_TOKENS]) - min(hf_cpu[1])) / steps
        names = set(sections[1][0]) | set(sections[DECODE_TOKENS][0])
        per_step = {  # ms per decode step: best of the runs, less the best one-token run (its prefill)
            name: 1e3
            * (min(r.get(name, 0.0) for r in sections[DECODE_TOKENS]) - min(r.get(name, 0.0) for r in sections[1]))
            / steps
            for name in names
        }
        host = per_step["step"] - (per_step.get("model", 0.0) - per_step.get("plan", 0.0))
        parts = {name: per_step.get(name, 0.0) for name in HOST_SECTIONS}
        parts["bookkeeping"] = host - sum(parts.values())
        cpu_step = per_step["step"] + per_step.get("publish", 0.0)
        first_step, first_cpu = first_step or our_step, first_cpu or cpu_step
        print(
            f"{batch:>6} {1e3 * our_step:>9.3f}ms {1e3 * hf_step:>7.3f}ms {hf_step / our_step:>8.2f}x "
            f"{our_step / first_step:>9.2f}x | {cpu_step:>8.3f}ms {hf_cpu_step:>5.3f}ms {hf_cpu_step / cpu_step:>7.2f}x "
            f"{cpu_step / first_cpu:>9.2f}x | {host:>5.3f}ms {1e3 * host / batch:>6.2f}us  "
            + " ".join(f"{name} {value:.3f}" for name, value in parts.items())
            + f" | model {per_step.get('model', 0.0) - per_step.get('plan', 0.0):.3f}"
            + f" (attention {per_step.get('attention', 0.0):.3f})"
        )
    llm.shutdown()


def measure_multi_step(batches: list[int], repeats: int, window_sizes: list[int]) -> None:
    """Decode step time with k decode steps per scheduling decision (`num_scheduler_steps=k`).

    The same tiny Llama and prompts as the decode table; one engine per k, each on its own copy of
    the model, runs interleaved. A step is (T(17 tokens) - T(1)) / 16 in wall clock and in the
    engine thread's CPU time (with its publishing), best of `repeats`; decisions are the
    scheduler's per 16 decode steps.
    """
    import copy

    torch.manual_seed(0)
    model = LlamaForCausalLM(shape_config("tiny")).eval()
    model.generation_config.eos_token_id = None
    engines = {
        k: nnrun.LLM(
            copy.deepcopy(model), max_num_seqs=max(batches), max_total_tokens=max(batches) * 32, num_scheduler_steps=k
        )
        for k in window_sizes
    }
    timers = {}
    for k, llm in engines.items():
        timers[k] = StepTimer(llm, time.thread_time)
        timers[k].wrap(llm, "_publish", "publish")
    print(f"\nmulti-step decode, tiny Llama, 8-token prompts, greedy; best of {repeats}; k = num_scheduler_steps")
    print(
        f"{'batch':>6} "
        + " ".join(f"{'k=' + str(k) + ' wall':>10} {'CPU':>7} {'dec.':>4}" for k in window_sizes)
        + "  wall vs k="
        + str(window_sizes[0])
    )
    steps = DECODE_TOKENS - 1
    for batch in batches:
        prompts = [[(7 * i + 3 * j) % 254 + 2 for j in range(8)] for i in range(batch)]
        wall: dict[tuple[int, int], list[float]] = defaultdict(list)
        cpu: dict[tuple[int, int], list[float]] = defaultdict(list)
        decisions: dict[int, int] = {}
        for k, llm in engines.items():  # warm-up
            llm.generate(prompts, nnrun.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        for _ in range(repeats):
            for num_tokens in (1, DECODE_TOKENS):
                params = nnrun.SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
                for k, llm in engines.items():
                    schedules = llm.core.scheduler.num_schedules
                    with timers[k].measuring():
                        start = time.perf_counter()
                        llm.generate(prompts, params)
                        wall[k, num_tokens].append(time.perf_counter() - start)
                        cpu[k, num_tokens].append(timers[k].seconds["step"] + timers[k].seconds["publish"])
                    if num_tokens == DECODE_TOKENS:
                        decisions[k] = llm.core.scheduler.num_schedules - schedules - 1  # less the prefill's
        per_step = {k: (min(wall[k, DECODE_TOKENS]) - min(wall[k, 1])) / steps for k in window_sizes}
        per_cpu = {k: (min(cpu[k, DECODE_TOKENS]) - min(cpu[k, 1])) / steps for k in window_sizes}
        first = per_step[window_sizes[0]]
        print(
            f"{batch:>6} "
            + " ".join(
                f"{1e3 * per_step[k]:>8.3f}ms {1e3 * per_cpu[k]:>5.3f}ms {decisions[k]:>4}" for k in window_sizes
            )
            + "  "
            + " ".join(f"{first / per_step[k]:.2f}x" for k in window_sizes)
        )
    for llm in engines.values():
        llm.shutdown()


# Ops that allocate or alias without a kernel, though their schemas do not say they alias.
_NO_KERNEL_OPS = {"_unsafe_view", "lift_fresh", "detach", "empty", "new_empty", "empty_strided", "alias"}


class AtenOpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while active, kernels and views apart, inside decoder layers and outside.

    A TorchDispatchMode is per thread: nnrun's forward is counted by entering it on the engine thread.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.in_layer = False
        self.layer_ops: Counter[str] = Counter()  # "kernel" / "view", and each op's name
        self.step_ops: Counter[str] = Counter()
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_: setattr(self, "in_layer", True))
            layer.register_forward_hook(lambda *_: setattr(self, "in_layer", False))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        returns = func._schema.returns
        aliases = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        kind = "view" if aliases or name in _NO_KERNEL_OPS else "kernel"
        (self.layer_ops if self.in_layer else self.step_ops).update((kind, f"{kind}:{name}"))
        return func(*args, **(kwargs or {}))

    def taken(self) -> tuple[Counter, Counter]:
        counts = self.layer_ops.copy(), self.step_ops.copy()
        self.layer_ops.clear()
        self.step_ops.clear()
        return counts


def measure_aten_ops(prompt_len: int) -> dict[str, tuple[Counter, Counter]]:
    """ATen ops per decoder layer and outside the layers per step, nnrun's forward against HF's own.

    One prompt of `prompt_len` tokens, then one decode step, on the tiny Llama in float32: HF's forward
    with a DynamicCache (sdpa), nnrun's `run_model` (torch attention backend, its plan included).
    """
    import copy

    torch.manual_seed(0)
    model = LlamaForCausalLM(shape_config("tiny")).eval()
    model.generation_config.eos_token_id = None
    hf = copy.deepcopy(model)
    num_layers = model.config.num_hidden_layers
    prompt = [(3 * j) % 254 + 2 for j in range(prompt_len)]
    counts: dict[str, tuple[Counter, Counter]] = {}
    counter = AtenOpCounter(hf)
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        with counter:
            logits = hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        counts["HF prefill"] = counter.taken()
        with counter:
            hf(logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True, logits_to_keep=1)
        counts["HF decode"] = counter.taken()
    llm = nnrun.LLM(model, attention_backend="torch")
    counter = AtenOpCounter(model)
    run_model = llm.runner.run_model

    def counted(forward_batch):
        with counter:
            logits = run_model(forward_batch)
        counts.setdefault(f"nnrun {forward_batch.forward_mode.value}", counter.taken())
        return logits

    llm.runner.run_model = counted
    llm.generate([prompt], nnrun.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    llm.shutdown()
    print(f"\nATen ops, tiny Llama ({num_layers} layers, float32, CPU), one {prompt_len}-token prompt, then decode")
    print(
        f"{'forward':>14} | {'per layer: kernels':>18} {'views':>6} | {'outside layers per step: kernels':>32} {'views':>6}"
    )
    for name in ("HF prefill", "nnrun extend", "HF decode", "nnrun decode"):
        layer_ops, step_ops = counts[name]
        print(
            f"{name:>14} | {layer_ops['kernel'] / num_layers:>18.1f} {layer_ops['view'] / num_layers:>6.1f} | "
            f"{step_ops['kernel']:>32d} {step_ops['view']:>6d}"
        )
    for name in ("nnrun extend", "nnrun decode"):
        hf_name = "HF prefill" if name.endswith("extend") else "HF decode"
        ours, theirs = counts[name][0], counts[hf_name][0]
        extra = {
            op.split(":", 1)[1]: (ours[op] - theirs[op]) / num_layers
            for op in sorted(set(ours) | set(theirs))
            if op.startswith("kernel:") and ours[op] != theirs[op]
        }
        print(f"  kernels per layer, {name} less {hf_name}: {extra}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--decode-only", action="store_true", help="only issue 36's decode table")
    parser.add_argument("--multi-step-only", action="store_true", help="only the multi-step table")
    parser.add_argument("--ops-only", action="store_true", help="only the aten-op table")
    parser.add_argument("--ops-prompt-len", type=int, default=64, help="prompt length of the aten-op table")
    parser.add_argument(
        "--window-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="num_scheduler_steps of the multi-step table"
    )
    parser.add_argument("--decode-repeats", type=int, default=3, help="runs per decode measurement; the best counts")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    measure_aten_ops(args.ops_prompt_len)
    if args.ops_only:
        return
    if not args.decode_only:
        measure_multi_step(args.batches, args.decode_repeats, args.window_sizes)
    if args.multi_step_only:
        return
    measure_decode(args.batches, args.decode_repeats)
    if args.decode_only:
        return
    print(f"torch threads {torch.get_num_threads()}; times are medians of {args.reps} interleaved rounds")
    measure("cheap Llama (1 layer, hidden 32): almost all fixed cost", llama(32, 1, 256), args)
    measure("small Llama (4 layers, hidden 256)", llama(256, 4, 1024), args)


if __name__ == "__main__":
    main()
