"""nnrun vs nnsight on HF: wall time of intervention workloads, printed as ratios.

Workloads (the same nnsight code runs on both; nnrun may also run traces from several threads,
which nnsight on HF cannot serve together):

1. patching sweep: patch the clean prompt's hidden state into the corrupted prompt at every
   (layer, position), reading the answer logit difference; one trace per patch;
2. 64 traces, each saving one layer's output of its own prompt.

Usage: python benchmarks/interventions.py [--layers 4] [--hidden 256] [--threads 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import threading
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

WORDS = ["the", "tower", "is", "in", "city", "of", "paris", "rome", "a", "big", "old", "river"]


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def build_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {"<pad>": 0, "<unk>": 1, **{word: i + 2 for i, word in enumerate(WORDS)}}
    table.update({f"w{i}": i for i in range(len(table), vocab)})
    backend = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    tokenizer.padding_side = "left"
    return tokenizer


def prompt(seed: int, length: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=generator).tolist())


# ---- workloads: plain nnsight code, the same on both models ----------------------------------
def patch_one(model, clean: str, corrupt: str, layer: int, position: int) -> float:
    with torch.no_grad():
        with model.trace() as tracer:
            with tracer.invoke(clean):
                source = model.model.layers[layer].output[:, position].clone()
            with tracer.invoke(corrupt):
                hidden = model.model.layers[layer].output
                hidden[:, position] = source
                logits = model.lm_head.output[0, -1]
                diff = (logits[2] - logits[3]).save()
    return float(diff)


def patch_all_in_one_trace(model, clean: str, corrupt: str, num_layers: int, num_positions: int) -> list[float]:
    with torch.no_grad():
        with model.trace() as tracer:
            sources = {}
            diffs = list().save()
            with tracer.invoke(clean):
                for layer in range(num_layers):
                    sources[layer] = model.model.layers[layer].output.clone()
            for layer in range(num_layers):
                for position in range(num_positions):
                    with tracer.invoke(corrupt):
                        hidden = model.model.layers[layer].output
                        hidden[:, position] = sources[layer][:, position]
                        logits = model.lm_head.output[0, -1]
                        diffs.append(logits[2] - logits[3])
    return [float(d) for d in diffs]


def save_one(model, text: str, layer: int) -> torch.Tensor:
    with torch.no_grad():
        with model.trace(text):
            hidden = model.model.layers[layer].output.save()
    return hidden


def sweep_tasks(args, tokenizer) -> list[tuple]:
    clean, corrupt = prompt(1, args.prompt_len), prompt(2, args.prompt_len)
    return [(clean, corrupt, layer, position) for layer in range(args.layers) for position in range(args.prompt_len)]


def run_sequential(fn, tasks, model) -> tuple[float, list]:
    start = time.perf_counter()
    results = [fn(model, *task) for task in tasks]
    return time.perf_counter() - start, results


def run_threads(fn, tasks, model, num_threads: int) -> tuple[float, list]:
    results: list = [None] * len(tasks)
    errors: list = []

    def worker(thread: int) -> None:
        try:
            for index in range(thread, len(tasks), num_threads):
                results[index] = fn(model, *tasks[index])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start, results


def check_same(name: str, expected: list, actual: list) -> None:
    for e, a in zip(expected, actual):
        if isinstance(e, list):
            check_same(name, e, a)
        elif isinstance(e, float):
            assert abs(e - a) < 1e-3 * max(1.0, abs(e)), f"{name}: {a} != HF's {e}"
        else:
            torch.testing.assert_close(a.float(), e.float(), atol=1e-3, rtol=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--num-traces", type=int, default=64)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    import nnsight

    import nnrun

    tokenizer = build_tokenizer(args.vocab)
    model = build_model(args)
    oracle = nnsight.LanguageModel(copy.deepcopy(model).to(args.device), tokenizer=tokenizer)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer, device=args.device)

    workloads = {
        f"patching sweep ({args.layers} layers x {args.prompt_len} positions)": (
            patch_one, sweep_tasks(args, tokenizer)),
        f"patching sweep in one trace of {args.layers * args.prompt_len + 1} invokes": (
            patch_all_in_one_trace, [(prompt(1, args.prompt_len), prompt(2, args.prompt_len), args.layers,
                                      args.prompt_len)]),
        f"{args.num_traces} traces saving one layer": (
            save_one, [(prompt(100 + i, 8 + i % 9), i % args.layers) for i in range(args.num_traces)]),
    }
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, device {args.device}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'workload':64s} {'nnsight+HF s':>13s} {'nnrun s':>9s} {'ratio':>7s}   (ratio = nnrun / nnsight+HF)")
    for name, (fn, tasks) in workloads.items():
        fn(oracle, *tasks[0])  # warm up both
        fn(ours, *tasks[0])
        hf_time, expected = run_sequential(fn, tasks, oracle)
        seq_time, sequential = run_sequential(fn, tasks, ours)
        check_same(name, expected, sequential)
        print(f"{name + ', one thread':64s} {hf_time:13.3f} {seq_time:9.3f} {seq_time / hf_time:7.2f}")
        if len(tasks) > 1:
            thr_time, threaded = run_threads(fn, tasks, ours, args.threads)
            check_same(name, expected, threaded)
            print(f"{name + f', nnrun {args.threads} threads':64s} {hf_time:13.3f} {thr_time:9.3f} "
                  f"{thr_time / hf_time:7.2f}")
    ours.shutdown()


if __name__ == "__main__":
    main()
