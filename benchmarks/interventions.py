"""nnrun vs nnsight on HF: wall time of intervention workloads, printed as ratios.

Workloads (the same nnsight code runs on both; nnrun may also run traces from several threads,
which nnsight on HF cannot serve together):

1. patching sweep: patch the clean prompt's hidden state into the corrupted prompt at every
   (layer, position), reading the answer logit difference; one trace per patch;
2. 64 traces, each saving one layer's output of its own prompt.

Then the targets of issue 15, each timed interleaved with its baseline (--reps rounds; the ratios of the
median rounds and of the best rounds):
a patching sweep of 16 equal-length patched invokes in one trace; 16 and 64 equal-length invokes
each saving a layer; greedy generation of 16 prompts x 32 new tokens against HF `generate` on the
small Llama and on a GPT-2-small shape (plain, and steered every step against nnsight+HF); steered
generation of 16 mixed-length prompts (`tracer.all()` adding a vector); single traces at 8/64/512.

`--only generation` prints issue 35's rows (benchmarks/generation_rows.py): a ~30M-parameter Llama,
--gen-prompts prompts of 16..48 tokens x --gen-tokens new tokens, greedy: the engine alone, traces
with nothing inside / one layer / its last row / every layer saved every step / a steering vector,
a prefill trace and its floor (the engine's prefill alone, whose ratio to nnsight on HF is the prefill
trace's ceiling, printed next to its own), HF `generate`, and nnsight on HF; seconds, ratios and the
cost per saved value in µs.

Usage: python benchmarks/interventions.py [--layers 4] [--hidden 256] [--threads 8] [--device cpu]
       [--only targets|classic|generation] [--reps 15] [--skip-gpt2]
       python benchmarks/interventions.py --only generation [--gen-prompts 16] [--gen-tokens 32]
       [--gen-layers 8] [--gen-hidden 512] [--gen-repeats 3] [--nnsight-all]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import threading
import time
import warnings

import generation_rows
import torch
from common import interleaved_runs, left_padded, llama_30m_config, random_prompts
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

WORDS = ["the", "tower", "is", "in", "city", "of", "paris", "rome", "a", "big", "old", "river"]


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
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


def save_in_invokes(model, prompts: list[str], num_layers: int) -> list[torch.Tensor]:
    """One trace, one invoke per prompt, each saving one layer's output."""
    with torch.no_grad():
        with model.trace() as tracer:
            saved = list().save()
            for i, text in enumerate(prompts):
                with tracer.invoke(text):
                    saved.append(model.model.layers[i % num_layers].output.save())
    return list(saved)


def single_trace(model, text: str, layer: int) -> list[torch.Tensor]:
    with torch.no_grad():
        with model.trace(text):
            hidden = model.model.layers[layer].output.save()
            logits = model.lm_head.output[0, -1].save()
    return [hidden, logits]


def steered_generate(model, prompts: list[str], layer: int, vector: torch.Tensor, max_new_tokens: int) -> None:
    """Generation with `vector` added to one layer's output at every step of every prompt (nnsight's all())."""
    with torch.no_grad():
        with model.generate(prompts, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens) as tracer:
            for _ in tracer.all():
                model.model.layers[layer].output[:] += vector


def steered_generate_invokes(model, prompts: list[str], layer: int, vector: torch.Tensor, max_new_tokens: int) -> None:
    """As `steered_generate`, with one invoke per prompt, each steering its own prompt."""
    with torch.no_grad():
        with model.generate(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens) as tracer:
            for text in prompts:
                with tracer.invoke(text):
                    for _ in tracer.all():
                        model.model.layers[layer].output[:] += vector


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> None:
    """HF `generate`: one left-padded batch of every prompt, greedy, exactly `max_new_tokens` each."""
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def engine_greedy(llm, prompts: list[list[int]], max_new_tokens: int) -> None:
    import nnrun

    llm.generate(prompts, nnrun.SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True))


def gpt2_small() -> GPT2LMHeadModel:
    """GPT-2 small's shape (124M: 12 layers, hidden 768, 12 heads, vocab 50257), random weights."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    model.generation_config.eos_token_id = None
    return model


def target_workloads(args, oracle, hf_model, ours, tokenizer) -> dict[str, tuple]:
    """Issue 15's targets: name -> (baseline thunk, nnrun thunk, baseline name)."""
    layers, gen_len = args.layers, args.gen_tokens
    clean, corrupt = prompt(1, 16), prompt(2, 16)
    equal = [prompt(200 + i, 16) for i in range(64)]
    mixed = [prompt(300 + i, 8 + (i * 7) % 25) for i in range(16)]
    mixed_ids = [tokenizer(text)["input_ids"] for text in mixed]
    vector = torch.linspace(-0.5, 0.5, args.hidden)
    patch_positions = 16 // layers
    both = lambda fn, *a: (lambda: fn(oracle, *a), lambda: fn(ours, *a), "nnsight+HF")  # noqa: E731
    workloads = {
        f"patching sweep: 1 clean + {layers * patch_positions} patched invokes, one trace": both(
            patch_all_in_one_trace, clean, corrupt, layers, patch_positions
        ),
        "16 equal-length invokes saving a layer, one trace": both(save_in_invokes, equal[:16], layers),
        "64 equal-length invokes saving a layer, one trace": both(save_in_invokes, equal, layers),
        f"greedy generation 16 prompts x {gen_len}, small Llama": (
            lambda: hf_greedy(hf_model, mixed_ids, gen_len),
            lambda: engine_greedy(ours.engine, mixed_ids, gen_len),
            "HF generate",
        ),
        f"steered generation 16 mixed-length invokes x {gen_len} (all())": both(
            steered_generate_invokes, mixed, 1, vector, gen_len
        ),
        f"steered generation 16 mixed-length prompts x {gen_len}, one invoke": both(
            steered_generate, mixed, 1, vector, gen_len
        ),
    }
    for length in (8, 64, 512):
        workloads[f"single trace, {length} tokens"] = both(single_trace, prompt(400 + length, length), 1)
    return workloads


def gpt2_workload(args) -> tuple:
    """Greedy generation on a GPT-2-small shape: HF generate vs the engine, the same weights."""
    import nnrun

    hf = gpt2_small()
    llm = nnrun.LLM(copy.deepcopy(hf))
    prompts = [[(17 * i + 31 * j) % 50000 + 1 for j in range(8 + (i * 7) % 25)] for i in range(16)]
    name = f"greedy generation 16 prompts x {args.gen_tokens}, GPT-2-small shape"
    return (
        name,
        (
            lambda: hf_greedy(hf, prompts, args.gen_tokens),
            lambda: engine_greedy(llm, prompts, args.gen_tokens),
            "HF generate",
        ),
        llm,
    )


def run_targets(args, oracle, hf_model, ours, tokenizer) -> None:
    workloads = target_workloads(args, oracle, hf_model, ours, tokenizer)
    cleanup = None
    if not args.skip_gpt2:
        name, entry, cleanup = gpt2_workload(args)
        workloads[name] = entry
    print(
        f"\nissue 15 targets, {args.reps} interleaved rounds (speedup = baseline s / nnrun s; >= 1.0 means nnrun "
        "is faster): of the medians, and of the best rounds (load on a shared CPU only ever adds time)"
    )
    print(f"{'workload':64s} {'baseline':>11s} {'base s':>8s} {'nnrun s':>8s} {'speedup':>8s} {'best':>6s}")
    for name, (baseline, theirs_or_ours, baseline_name) in workloads.items():
        baseline()  # warm up both
        theirs_or_ours()
        base_times, our_times = interleaved_runs(baseline, theirs_or_ours, args.reps)
        base_time, our_time = statistics.median(base_times), statistics.median(our_times)
        print(
            f"{name:64s} {baseline_name:>11s} {base_time:8.3f} {our_time:8.3f} {base_time / our_time:8.2f} "
            f"{min(base_times) / min(our_times):6.2f}",
            flush=True,
        )
    if cleanup is not None:
        cleanup.shutdown()


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


def run_generation(args) -> None:
    """Issue 35's rows on one ~30M Llama (`--gen-layers`/`--gen-hidden` shrink it for a quick run)."""
    import nnsight

    import nnrun

    config = llama_30m_config()
    config.num_hidden_layers = args.gen_layers or config.num_hidden_layers
    if args.gen_hidden:
        config.hidden_size, config.intermediate_size = args.gen_hidden, args.gen_hidden * 11 // 4
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, None, None
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    tokenizer = generation_rows.word_tokenizer(config.vocab_size)
    prompt_ids = random_prompts(args.gen_prompts, 16, 48, config.vocab_size, seed=35)
    setup = generation_rows.GenerationSetup.for_model(config, prompt_ids, args.gen_tokens)
    hf_model = copy.deepcopy(model).to(args.device)
    oracle = nnsight.LanguageModel(hf_model, tokenizer=tokenizer)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer, device=args.device)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: Llama {config.num_hidden_layers} layers, hidden {config.hidden_size}, {params / 1e6:.1f}M params, "
        f"device {args.device}, torch threads {torch.get_num_threads()}; {args.gen_prompts} prompts of 16..48 tokens "
        f"x {args.gen_tokens} new tokens, greedy, one invoke per prompt; best of {args.gen_repeats} rounds "
        f"({'CPU' if args.device == 'cpu' else 'wall'} seconds)"
    )
    rows = generation_rows.workloads(ours, oracle, hf_model, setup, nnsight_all=args.nnsight_all)
    seconds = generation_rows.best_times(rows, args.gen_repeats, cpu=args.device == "cpu")
    generation_rows.print_report(generation_rows.report(seconds, setup), heading=None)
    ours.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--num-traces", type=int, default=64)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=["targets", "classic", "generation"], default=None)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--skip-gpt2", action="store_true")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--gen-prompts", type=int, default=16)
    parser.add_argument("--gen-layers", type=int, default=None, help="default: the 30M Llama's 8")
    parser.add_argument("--gen-hidden", type=int, default=None, help="default: the 30M Llama's 512")
    parser.add_argument("--gen-repeats", type=int, default=3)
    parser.add_argument("--nnsight-all", action="store_true", help="nnsight on HF for every traced row")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    warnings.simplefilter("ignore")
    if args.only == "generation":
        run_generation(args)
        return

    import nnsight

    import nnrun

    tokenizer = build_tokenizer(args.vocab)
    model = build_model(args)
    hf_model = copy.deepcopy(model).to(args.device)
    oracle = nnsight.LanguageModel(hf_model, tokenizer=tokenizer)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer, device=args.device)

    if args.only != "classic":
        run_targets(args, oracle, hf_model, ours, tokenizer)
    if args.only == "targets":
        ours.shutdown()
        return
    workloads = {
        f"patching sweep ({args.layers} layers x {args.prompt_len} positions)": (
            patch_one,
            sweep_tasks(args, tokenizer),
        ),
        f"patching sweep in one trace of {args.layers * args.prompt_len + 1} invokes": (
            patch_all_in_one_trace,
            [(prompt(1, args.prompt_len), prompt(2, args.prompt_len), args.layers, args.prompt_len)],
        ),
        f"{args.num_traces} traces saving one layer": (
            save_one,
            [(prompt(100 + i, 8 + i % 9), i % args.layers) for i in range(args.num_traces)],
        ),
    }
    print(
        f"model: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, device {args.device}, "
        f"torch threads {torch.get_num_threads()}"
    )
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
            print(
                f"{name + f', nnrun {args.threads} threads':64s} {hf_time:13.3f} {thr_time:9.3f} "
                f"{thr_time / hf_time:7.2f}"
            )
    ours.shutdown()


if __name__ == "__main__":
    main()
