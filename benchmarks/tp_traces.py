"""nnsight traces on tensor-parallel ranks: traced throughput at TP=2 against TP=1, and what tracing costs there.

The dummy Llama of benchmarks/tp.py, as `nnrun.LanguageModel` with one rank (one process) and with two
ranks, in alternating rounds. Each round: one trace of every prompt as its own invoke (a save of a
middle layer's last position and a steering edit of another layer), then one generation trace (the
edit at every step, the ids saved); and, on the two-rank model, the same generation untraced, to show
what serializing blocks and running them on every rank costs against the plain rank path.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from common import random_prompts
from transformers import AutoModelForCausalLM

import nnrun
from tp import bench_config


def traced_round(model: nnrun.LanguageModel, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """Seconds for the prefill trace and the generation trace; tokens processed."""
    middle = len(model.model.layers) // 2
    start = time.perf_counter()
    with model.trace() as tracer:
        saved = list().save()
        for prompt in prompts:
            with tracer.invoke(prompt):
                model.model.layers[middle - 1].output[:, -1] *= 1.01
                saved.append(model.model.layers[middle].output[:, -1].save())
    with model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens) as tracer:
        for _ in tracer.iter[:new_tokens]:
            model.model.layers[middle - 1].output[:] *= 1.01
        ids = tracer.result.save()
    seconds = time.perf_counter() - start
    assert len(saved) == len(prompts) and ids.shape[0] == len(prompts)
    return seconds, 2 * sum(map(len, prompts)) + len(prompts) * new_tokens


def plain_round(model: nnrun.LanguageModel, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """The same work untraced (the engine's own generate): the rank path without blocks."""
    greedy = nnrun.SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    model.engine.generate(prompts, greedy)
    model.engine.generate(prompts, nnrun.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - start, 2 * sum(map(len, prompts)) + len(prompts) * new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process (a rank gets 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = bench_config(args.hidden, args.layers)
    prompts = random_prompts(args.num_prompts, 16, 128, config.vocab_size)
    with tempfile.TemporaryDirectory(prefix="nnrun-tp-traces-") as checkpoint:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
        print(
            f"model: dummy Llama, hidden {args.hidden}, {args.layers} layers; {len(prompts)} prompts, "
            f"{sum(map(len, prompts))} prompt tokens, {args.max_new_tokens} new tokens each"
        )
        models = {
            "TP=1 traced": nnrun.LanguageModel(checkpoint, max_num_batched_tokens=4096),
            "TP=2 traced": nnrun.LanguageModel(checkpoint, tensor_parallel_size=2, max_num_batched_tokens=4096),
        }
        rounds = {**{name: (model, traced_round) for name, model in models.items()}}
        rounds["TP=2 untraced"] = (models["TP=2 traced"], plain_round)
        rates: dict[str, list[float]] = {name: [] for name in rounds}
        try:
            for name, (model, run) in rounds.items():  # warm-up
                run(model, prompts[:2], 2)
            for _ in range(args.rounds):
                for name, (model, run) in rounds.items():
                    seconds, tokens = run(model, prompts, args.max_new_tokens)
                    rates[name].append(tokens / seconds)
        finally:
            for model in models.values():
                model.shutdown()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        print(
            f"{name:<16} {medians[name]:8.0f} tokens/s  (median of {args.rounds}: {', '.join(f'{v:.0f}' for v in values)})"
        )
    print(f"TP=2 / TP=1, traced: {medians['TP=2 traced'] / medians['TP=1 traced']:.2f}x")
    print(f"TP=2 traced / untraced: {medians['TP=2 traced'] / medians['TP=2 untraced']:.2f}x")


if __name__ == "__main__":
    main()
