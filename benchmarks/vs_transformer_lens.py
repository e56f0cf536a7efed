"""TransformerLens as an anchor: the same random-weight model and workloads on TransformerLens 4.3,
nnsight on HF and nnrun, timed interleaved in one process.

TransformerLens 4.x has no HookedTransformer any more: `TransformerBridge.boot_transformers(...,
hf_model=model)` wraps the HF module tree in hook points and switches it to eager attention. Its
weight processing (fold_ln, center_writing_weights, ...) happens only in `enable_compatibility_mode()`,
which this script never calls, so TL's `blocks.{i}.hook_resid_post` is HF's decoder layer output and
values are compared directly (max abs difference printed per workload).

Workloads, each written the idiomatic way for each library:
1. single trace saving a layer (and the last logits), at each of --lengths;
2. activation-patching sweep, 4 layers x 4 positions: one forward of 1 clean + 16 patched prompts
   (TL: a 17-row batch whose hooks copy the clean row; nnsight, nnrun: one trace of 17 invokes);
3. the same sweep one patch at a time: the clean activations saved once, then 16 one-prompt runs;
4. 64 mixed-length prompts, each saving layer i % num_layers (TL: one left-padded batch with hooks;
   nnsight, nnrun: one trace of 64 invokes), and nnrun again as 64 traces from 8 threads;
5. steered greedy generation of 16 mixed-length prompts x --gen-tokens, a vector added to layer 1's
   output at every step (TL: `generate` inside `hooks()`; nnsight, nnrun: `tracer.iter[:n]`).

The file is not called transformer_lens.py on purpose: run as a script, that name would shadow the
package for every script in benchmarks/ (sae-lens imports it too).

Usage: python benchmarks/vs_transformer_lens.py [--arch llama|gpt2] [--reps 5] [--gen-tokens 32]
       [--lengths 16,256] [--threads 8]
Needs `pip install -e ".[bench]"`; without transformer-lens it says so and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.util
import statistics
import time
import warnings

import torch
from interventions import build_tokenizer, prompt, run_threads
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

STEER_LAYER = 1


def build_model(arch: str, vocab: int, hidden: int, num_layers: int):
    """Random weights from a fixed seed; no EOS so every prompt generates exactly the tokens asked."""
    torch.manual_seed(0)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 4,
            num_hidden_layers=num_layers,
            num_attention_heads=max(1, hidden // 64),
            num_key_value_heads=max(1, hidden // 128),
            max_position_embeddings=1024,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = LlamaForCausalLM(config)
    else:
        config = GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=num_layers,
            n_head=max(1, hidden // 64),
            n_positions=1024,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = GPT2LMHeadModel(config)
    model.generation_config.eos_token_id = None
    return model.eval()


def blocks(model):
    """The decoder layers of an HF model or of its nnsight/nnrun envoy (their output: [B, T, H])."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def left_pad(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """([B, T_max] ids, [B, T_max] mask, lengths), left-padded with id 0 as HF pads a batch."""
    rows = [tokenizer(text)["input_ids"] for text in texts]
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask, [len(row) for row in rows]


def resid_post(layer: int) -> str:
    return f"blocks.{layer}.hook_resid_post"


# ---- TransformerLens ------------------------------------------------------------------------------
def tl_single(bridge, ids: torch.Tensor, layer: int) -> list[torch.Tensor]:
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids, names_filter=resid_post(layer))
    return [cache[resid_post(layer)], logits[0, -1]]


def tl_patch_batched(bridge, clean: torch.Tensor, corrupt: torch.Tensor, patches: list[tuple[int, int]]):
    """One forward: row 0 clean, row 1 + k the corrupt prompt with patch k copied from row 0."""

    def patch_layer(layer: int):
        rows = [(1 + k, position) for k, (at, position) in enumerate(patches) if at == layer]

        def hook(act, hook):  # [1 + num_patches, T, H]
            for row, position in rows:
                act[row, position] = act[0, position]
            return act

        return hook

    batch = torch.cat([clean, corrupt.expand(len(patches), -1)])
    hooks = [(resid_post(layer), patch_layer(layer)) for layer in sorted({at for at, _ in patches})]
    with torch.no_grad():
        logits = bridge.run_with_hooks(batch, fwd_hooks=hooks)
    return (logits[1:, -1, 2] - logits[1:, -1, 3]).tolist()


def tl_patch_loop(bridge, clean: torch.Tensor, corrupt: torch.Tensor, patches: list[tuple[int, int]]):
    """TL's usual sweep: cache the clean run once, then one hooked forward per patch."""
    layers = sorted({at for at, _ in patches})
    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean, names_filter=[resid_post(layer) for layer in layers])
        diffs = []
        for layer, position in patches:

            def hook(act, hook, layer=layer, position=position):
                act[:, position] = cache[resid_post(layer)][:, position]
                return act

            logits = bridge.run_with_hooks(corrupt, fwd_hooks=[(resid_post(layer), hook)])
            diffs.append(float(logits[0, -1, 2] - logits[0, -1, 3]))
    return diffs


def tl_save_batch(bridge, ids: torch.Tensor, mask: torch.Tensor, lengths: list[int], num_layers: int):
    """One left-padded forward; prompt i keeps layer i % num_layers, unpadded: [1, T_i, H]."""
    saved: list = [None] * len(lengths)

    def save_layer(layer: int):
        def hook(act, hook):  # [B, T_max, H]
            for row in range(layer, len(lengths), num_layers):
                saved[row] = act[row : row + 1, act.shape[1] - lengths[row] :].clone()

        return hook

    with torch.no_grad():
        bridge.run_with_hooks(
            ids, attention_mask=mask, fwd_hooks=[(resid_post(layer), save_layer(layer)) for layer in range(num_layers)]
        )
    return saved


def tl_steered(bridge, ids: torch.Tensor, mask: torch.Tensor, vector: torch.Tensor, max_new_tokens: int):
    def steer(act, hook):
        return act + vector

    with torch.no_grad(), bridge.hooks(fwd_hooks=[(resid_post(STEER_LAYER), steer)]):
        out = bridge.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            stop_at_eos=False,
            return_type="tokens",
            verbose=False,
        )
    return out[:, -max_new_tokens:]


# ---- nnsight on HF and nnrun: the same nnsight code -----------------------------------------------
def nn_single(model, text: str, layer: int) -> list[torch.Tensor]:
    with torch.no_grad(), model.trace(text):
        hidden = blocks(model)[layer].output.save()
        logits = model.lm_head.output[0, -1].save()
    return [hidden, logits]


def nn_patch_batched(model, clean: str, corrupt: str, patches: list[tuple[int, int]]):
    layers = sorted({at for at, _ in patches})
    with torch.no_grad():
        with model.trace() as tracer:
            sources = {}
            diffs = list().save()
            with tracer.invoke(clean):
                for layer in layers:
                    sources[layer] = blocks(model)[layer].output.clone()
            for layer, position in patches:
                with tracer.invoke(corrupt):
                    hidden = blocks(model)[layer].output  # wait for the layer first: the clean invoke fills sources
                    hidden[:, position] = sources[layer][:, position]
                    logits = model.lm_head.output[0, -1]
                    diffs.append(logits[2] - logits[3])
    return [float(d) for d in diffs]


def nn_patch_loop(model, clean: str, corrupt: str, patches: list[tuple[int, int]]):
    layers = sorted({at for at, _ in patches})
    with torch.no_grad():
        with model.trace(clean):
            saved = list().save()  # only saved values leave a trace
            for layer in layers:
                saved.append(blocks(model)[layer].output)
        sources = dict(zip(layers, saved))
        diffs = []
        for layer, position in patches:
            with model.trace(corrupt):
                blocks(model)[layer].output[:, position] = sources[layer][:, position]
                logits = model.lm_head.output[0, -1]
                diff = (logits[2] - logits[3]).save()
            diffs.append(float(diff))
    return diffs


def nn_save_invokes(model, texts: list[str], num_layers: int) -> list[torch.Tensor]:
    with torch.no_grad(), model.trace() as tracer:
        saved = dict().save()  # by prompt: invokes saving earlier layers finish first
        for i, text in enumerate(texts):
            with tracer.invoke(text):
                saved[i] = blocks(model)[i % num_layers].output
    return [saved[i] for i in range(len(texts))]


def nnrun_save_threads(model, texts: list[str], num_layers: int, num_threads: int) -> list[torch.Tensor]:
    """One trace per prompt, from `num_threads` threads: the engine batches them into shared steps."""
    tasks = [(text, i % num_layers) for i, text in enumerate(texts)]
    return run_threads(save_one_trace, tasks, model, num_threads)[1]


def save_one_trace(model, text: str, layer: int) -> torch.Tensor:
    with torch.no_grad(), model.trace(text):
        hidden = blocks(model)[layer].output.save()
    return hidden


def nn_steered(model, texts: list[str], vector: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        with model.generate(texts, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens) as tracer:
            for _ in tracer.iter[:max_new_tokens]:  # every step; bounded so that the line after it runs
                blocks(model)[STEER_LAYER].output[:] += vector
            ids = tracer.result.save()
    return ids[:, -max_new_tokens:]


# ---- timing and checks ----------------------------------------------------------------------------
def max_diff(expected, actual) -> float:
    """Largest absolute difference between two (nested lists of) tensors or floats."""
    if isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), f"{len(expected)} results != {len(actual)}"
        return max((max_diff(e, a) for e, a in zip(expected, actual)), default=0.0)
    if isinstance(expected, float):
        return abs(expected - actual)
    if expected.dim() == 3 and actual.shape[1] > expected.shape[1]:
        actual = actual[:, -expected.shape[1] :]  # nnsight's invoke of a padded batch keeps the left padding
    assert expected.shape == actual.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return (expected.float() - actual.float()).abs().max().item()


def interleaved(thunks: dict, reps: int) -> dict[str, float]:
    """Median seconds of each thunk over `reps` rounds, rotating which runs first."""
    names = list(thunks)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            thunks[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def workloads(args, tokenizer, tl, ns, ours) -> dict[str, dict]:
    """name -> {"TL": thunk, "nnsight": thunk, "nnrun": thunk}; each thunk returns comparable values."""
    num_layers = args.layers
    clean, corrupt = prompt(1, 16), prompt(2, 16)
    clean_ids, corrupt_ids = (torch.tensor([tokenizer(t)["input_ids"]]) for t in (clean, corrupt))
    patches = [(layer, position) for layer in range(num_layers) for position in range(16 // num_layers)]
    mixed = [prompt(300 + i, 8 + (i * 7) % 25) for i in range(64)]
    mixed_ids, mixed_mask, mixed_lens = left_pad(tokenizer, mixed)
    gen_ids, gen_mask, _ = left_pad(tokenizer, mixed[:16])
    vector = torch.linspace(-0.5, 0.5, args.hidden)
    jobs = {}
    for length in args.lengths:
        text = prompt(400 + length, length)
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        jobs[f"single trace saving a layer, {length} tokens"] = {
            "TL": lambda ids=ids: tl_single(tl, ids, 1),
            "nnsight": lambda text=text: nn_single(ns, text, 1),
            "nnrun": lambda text=text: nn_single(ours, text, 1),
        }
    jobs[f"patching sweep, 1 clean + {len(patches)} patched, one forward"] = {
        "TL": lambda: tl_patch_batched(tl, clean_ids, corrupt_ids, patches),
        "nnsight": lambda: nn_patch_batched(ns, clean, corrupt, patches),
        "nnrun": lambda: nn_patch_batched(ours, clean, corrupt, patches),
    }
    jobs[f"patching sweep, clean cached + {len(patches)} one-prompt runs"] = {
        "TL": lambda: tl_patch_loop(tl, clean_ids, corrupt_ids, patches),
        "nnsight": lambda: nn_patch_loop(ns, clean, corrupt, patches),
        "nnrun": lambda: nn_patch_loop(ours, clean, corrupt, patches),
    }
    jobs["64 mixed-length prompts (8..32) saving a layer, one forward"] = {
        "TL": lambda: tl_save_batch(tl, mixed_ids, mixed_mask, mixed_lens, num_layers),
        "nnsight": lambda: nn_save_invokes(ns, mixed, num_layers),
        "nnrun": lambda: nn_save_invokes(ours, mixed, num_layers),
    }
    jobs[f"  same, nnrun as 64 traces from {args.threads} threads"] = {
        "TL": jobs["64 mixed-length prompts (8..32) saving a layer, one forward"]["TL"],
        "nnsight": jobs["64 mixed-length prompts (8..32) saving a layer, one forward"]["nnsight"],
        "nnrun": lambda: nnrun_save_threads(ours, mixed, num_layers, args.threads),
    }
    jobs[f"steered greedy generation, 16 mixed-length prompts x {args.gen_tokens}"] = {
        "TL": lambda: tl_steered(tl, gen_ids, gen_mask, vector, args.gen_tokens),
        "nnsight": lambda: nn_steered(ns, mixed[:16], vector, args.gen_tokens),
        "nnrun": lambda: nn_steered(ours, mixed[:16], vector, args.gen_tokens),
    }
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--lengths", type=lambda s: [int(n) for n in s.split(",")], default=[16, 256])
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    if importlib.util.find_spec("transformer_lens") is None:
        print('transformer_lens is not installed: skipping (pip install -e ".[bench]" installs 4.3)')
        return
    torch.set_num_threads(args.torch_threads)
    warnings.simplefilter("ignore")

    from transformer_lens.model_bridge import TransformerBridge

    import nnsight

    import nnrun

    tokenizer = build_tokenizer(args.vocab)
    model = build_model(args.arch, args.vocab, args.hidden, args.layers)
    # The bridge swaps in its own wrappers and eager attention on the model it gets: give it a copy.
    tl = TransformerBridge.boot_transformers(
        f"random-{args.arch}", hf_model=copy.deepcopy(model), tokenizer=tokenizer, device="cpu"
    )
    ns = nnsight.LanguageModel(copy.deepcopy(model), tokenizer=tokenizer)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer)
    print(
        f"model: random {args.arch}, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32 CPU, "
        f"torch {torch.__version__} ({torch.get_num_threads()} thread), transformer_lens "
        f"{importlib.metadata.version('transformer-lens')}, "
        f"nnsight {nnsight.__version__}"
    )
    print(
        f"median of {args.reps} interleaved rounds; 'x TL' = TL seconds / its seconds (> 1: faster than TL); "
        f"'diff' = max |value - TL's value| (tokens: mismatching count)"
    )
    print(
        f"{'workload':66s} {'TL s':>7s} {'nnsight s':>9s} {'nnrun s':>8s} {'nnsight x TL':>12s} "
        f"{'nnrun x TL':>10s} {'diff nnsight':>12s} {'diff nnrun':>10s}"
    )
    try:
        for name, thunks in workloads(args, tokenizer, tl, ns, ours).items():
            results = {side: thunk() for side, thunk in thunks.items()}  # warm-up, and the values to compare
            if isinstance(results["TL"], torch.Tensor) and results["TL"].dtype == torch.int64:  # generated ids
                diffs = [int((results[side] != results["TL"]).sum()) for side in ("nnsight", "nnrun")]
            else:
                diffs = [max_diff(results["TL"], results[side]) for side in ("nnsight", "nnrun")]
            median = interleaved(thunks, args.reps)
            print(
                f"{name:66s} {median['TL']:7.3f} {median['nnsight']:9.3f} {median['nnrun']:8.3f} "
                f"{median['TL'] / median['nnsight']:12.2f} {median['TL'] / median['nnrun']:10.2f} "
                f"{diffs[0]:12.2g} {diffs[1]:10.2g}",
                flush=True,
            )
    finally:
        ours.shutdown()


if __name__ == "__main__":
    main()
