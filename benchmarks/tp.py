"""Tensor parallelism: throughput at TP=2 against TP=1 on one workload, and the share of time in collectives.

A dummy-weight Llama (saved once as a checkpoint: each rank reads its own shard) runs the same
prefill and greedy-generation workload three ways in one run, in alternating rounds: the plain engine (one process),
the rank path with one rank (front end + one rank process: the cost of the split alone), and
two ranks. For two ranks it then runs the workload again with rank 0's collectives timed by
torch's profiler, and prints their share of that run's wall time. On one machine the ranks
share its cores, so on a CPU box the ratio says what the split and the collectives cost, not
what separate GPUs would gain (docs/scaling.md works that out from the bytes per step).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from common import random_prompts
from transformers import AutoModelForCausalLM, LlamaConfig

import nnrun
from nnrun.tp import TensorParallelRunner


def bench_config(hidden: int, layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=16384,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def run_workload(llm: nnrun.LLM, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
    """Seconds for one prefill pass and one greedy generation pass; tokens processed (prompt + generated)."""
    start = time.perf_counter()
    llm.generate(prompts, nnrun.SamplingParams(max_tokens=1, temperature=0.0))
    outputs = llm.generate(prompts, nnrun.SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
    seconds = time.perf_counter() - start
    num_tokens = 2 * sum(map(len, prompts)) + sum(len(o.outputs[0].token_ids) for o in outputs)
    return seconds, num_tokens


def measure(engines: dict[str, nnrun.LLM], prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """Median tokens/s of each engine over rounds that alternate between them (the machine's noise is shared)."""
    for llm in engines.values():
        llm.generate(prompts[:2], nnrun.SamplingParams(max_tokens=2))  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            seconds, num_tokens = run_workload(llm, prompts, args.max_new_tokens)
            rates[name].append(num_tokens / seconds)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        print(
            f"{name:<28} {medians[name]:8.0f} tokens/s  (median of {args.rounds}: "
            f"{', '.join(f'{v:.0f}' for v in values)})"
        )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the one-process engine; a CPU rank gets this many divided by N "
        "(at least 1): one thread per rank mirrors one device per rank",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = bench_config(args.hidden, args.layers)
    prompts = random_prompts(args.num_prompts, 32, 256, config.vocab_size)
    with tempfile.TemporaryDirectory(prefix="nnrun-tp-bench-") as checkpoint:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        print(
            f"model: dummy Llama, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, hidden "
            f"{args.hidden}, {args.layers} layers; {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
            f"{args.max_new_tokens} new tokens each; {torch.get_num_threads()} torch threads in this process"
        )
        model.save_pretrained(checkpoint)
        del model
        options = dict(device=args.device, max_num_batched_tokens=4096)

        engines = {
            "TP=1, one process": nnrun.LLM(checkpoint, **options),
            "TP=1, front end + 1 rank": nnrun.LLM(checkpoint, runner_cls=TensorParallelRunner, **options),
            "TP=2, front end + 2 ranks": nnrun.LLM(checkpoint, tensor_parallel_size=2, **options),
        }
        try:
            rates = measure(engines, prompts, args)
            two_ranks = engines["TP=2, front end + 2 ranks"]
            with two_ranks.runner.profile_collectives() as stats:
                run_workload(two_ranks, prompts, args.max_new_tokens)
        finally:
            for llm in engines.values():
                llm.shutdown()

    plain, split, two = rates.values()
    print(f"TP=2 / TP=1 throughput: {two / plain:.2f}x (the split alone, one rank: {split / plain:.2f}x)")
    print(
        f"TP=2 rank 0 in collectives: {stats['collective_s']:.2f} s of {stats['wall_s']:.2f} s "
        f"({100 * stats['collective_s'] / stats['wall_s']:.0f}%, {stats['num_collectives']:.0f} collectives, "
        "profiled run; includes waiting for the other rank)"
    )


if __name__ == "__main__":
    main()
