"""Half precision as HF runs it (issue 34): nnrun's bf16 values against HF's own bf16 rounding.

Random weights in a real Llama shape, one fp32 copy as the oracle. Mixed-length prompts (46..252 tokens
on a GPU), and for each the relative error (||x - x_fp32|| / ||x_fp32||) of the middle layer's output
and of the logits, from:

  HF alone          plain HF in the half dtype, each prompt alone (sdpa): the rounding HF itself gives
  nnsight on HF     one nnsight trace over every prompt as its own invoke (HF left-pads them)
  nnrun <backend>   one nnrun trace, one invoke per prompt, packed in one forward, per attention backend

nnrun passes where its error is within HF's own spread: at most `--slack` times the larger of HF alone's
and nnsight on HF's error for that prompt (their difference is HF's padded-vs-alone rounding). An error
that grows with the prompt's length where HF's stays flat is the failure this guards against (RoPE's
frequencies cast to bf16 gave 4.6% at 46 tokens, 13.9% at 252 on the 8B shape, HF 4.2-4.7%).

    python benchmarks/half_precision.py --shape 8b            # on a GPU: FlashInfer and the torch backend
    python benchmarks/half_precision.py --shape tiny          # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings

import generation_rows
import torch
from common import random_prompts, shape_config
from transformers import AutoModelForCausalLM

import nnrun
from nnrun.hf_dtypes import cast_like_hf

GPU_LENGTHS = (46, 70, 95, 131, 160, 190, 221, 252)
CPU_LENGTHS = (9, 17, 30, 44)


def relative_error(value: torch.Tensor, oracle: torch.Tensor) -> float:
    return ((value.float() - oracle.float()).norm() / oracle.float().norm()).item()


@torch.no_grad()
def hf_alone(model: torch.nn.Module, prompts: list[list[int]], layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(layer output [T, H], logits [T, V]) of each prompt run alone through plain HF, on the host in fp32."""
    seen = []
    hook = model.model.layers[layer].register_forward_hook(
        lambda module, args, output: seen.append(output[0] if isinstance(output, tuple) else output)
    )
    try:
        values = []
        for ids in prompts:
            seen.clear()
            logits = model(torch.tensor([ids], device=model.device)).logits[0]
            values.append((seen[0][0].float().cpu(), logits.float().cpu()))
        return values
    finally:
        hook.remove()


def traced(model, prompts: list[str], layer: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One trace, one invoke per prompt, on nnsight's or nnrun's LanguageModel: each prompt's own rows
    (nnsight on HF left-pads the batch: the last `length` rows are the prompt's)."""
    saved = []
    with model.trace() as tracer:
        for text in prompts:
            with tracer.invoke(text):
                saved.append((model.model.layers[layer].output.save(), model.lm_head.output.save()))
    values = []
    for (hidden, logits), length in zip(saved, lengths):
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden  # [1, T(+pad), H]
        values.append((hidden[0, -length:].float().cpu(), logits[0, -length:].float().cpu()))
    return values


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "1b", "8b"), default="8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--backends", default=None, help="comma list (default: flashinfer,torch on CUDA, torch on CPU)")
    parser.add_argument("--slack", type=float, default=1.25, help="nnrun's error may be this times HF's")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--out", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    backends = (args.backends or ("flashinfer,torch" if device.type == "cuda" else "torch")).split(",")
    config = shape_config(args.shape)
    layer = config.num_hidden_layers // 2
    lengths = list(GPU_LENGTHS if device.type == "cuda" else CPU_LENGTHS)
    prompt_ids = [random_prompts(1, n, n, config.vocab_size, seed=34 + n)[0] for n in lengths]
    prompts = generation_rows.word_prompts(prompt_ids)
    tokenizer = generation_rows.word_tokenizer(config.vocab_size)

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    oracle = hf_alone(model, prompt_ids, layer)
    model = cast_like_hf(model, dtype, in_place=True)  # what from_pretrained(dtype=...) leaves: inv_freq fp32
    print(
        f"{args.shape} Llama, {args.dtype}, layer {layer} of {config.num_hidden_layers}, prompts of {lengths} tokens; "
        f"RoPE inv_freq {model.model.rotary_emb.inv_freq.dtype}; device {device}"
    )
    results = {"HF alone": hf_alone(model, prompt_ids, layer)}
    import nnsight

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results["nnsight on HF"] = traced(nnsight.LanguageModel(model, tokenizer=tokenizer), prompts, layer, lengths)
    forward_paths = {}
    for backend in backends:
        ours = nnrun.LanguageModel(
            model,
            tokenizer=tokenizer,
            device=str(device),
            dtype=dtype,
            attention_backend=backend,
            max_num_seqs=len(prompts),
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        runner = ours.engine.runner
        forward_paths[backend] = "packed" if runner.exact_forward is None else f"exact ({runner.exact_forward.reason})"
        results[f"nnrun {backend}"] = traced(ours, prompts, layer, lengths)
        ours.shutdown()
        del ours
        gc.collect()
    print(f"nnrun forward path: {forward_paths}")

    rows, failures = [], []
    for i, length in enumerate(lengths):
        row = {"tokens": length}
        for name, values in results.items():
            hidden, logits = values[i]
            row[name] = (relative_error(hidden, oracle[i][0]), relative_error(logits, oracle[i][1]))
        hf_spread = [max(row["HF alone"][k], row["nnsight on HF"][k]) for k in (0, 1)]
        for backend in backends:
            for k, what in enumerate(("layer", "logits")):
                if row[f"nnrun {backend}"][k] > args.slack * hf_spread[k]:
                    failures.append(f"{length} tokens, {backend}, {what}: {row[f'nnrun {backend}'][k]:.2%}")
        rows.append(row)
    names = list(results)
    print(f"\nrelative error against fp32, layer {layer} output / logits\n")
    print("| tokens | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for row in rows:
        print(f"| {row['tokens']} | " + " | ".join(f"{row[n][0]:.2%} / {row[n][1]:.2%}" for n in names) + " |")
    verdict = "FAIL: " + "; ".join(failures) if failures else f"PASS: nnrun within {args.slack}x HF's own rounding"
    print(f"\n{verdict}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "dtype": args.dtype, "paths": forward_paths, "rows": rows}, f, indent=2)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
