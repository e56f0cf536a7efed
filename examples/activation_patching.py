"""Activation patching: a block x position sweep between a clean and a corrupted prompt, as concurrent traces.

Each cell of the sweep copies one residual state (a block's output at one position) from the
corrupted run into the clean run and measures how far the answer moves toward the corrupted
one: 0 keeps the clean answer, 1 gives the corrupted answer as strongly as the corrupted run.
Every cell is its own trace, submitted from a pool of threads; the engine batches them.

On tiny-facts the two museums' names sit at their last token (" Museum") in blocks 0-1 and at the
prompt's last token from block 2 on (nnrun/assets/interchange.py trains it so).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from common import find_layout, parser, single_token_id, token_labels

import nnrun


def patched_logit_diff(
    model: Any, parts: Any, clean: str, corrupt: str, answer_ids: tuple[int, int], layer_idx: int, position: int
) -> float:
    """logit(corrupt answer) - logit(clean answer) on `clean` with one residual state from `corrupt`."""
    layers = parts.layers
    with model.trace() as tracer:
        with tracer.invoke(corrupt):
            source = layers[layer_idx].output[:, position]
        with tracer.invoke(clean):
            hidden = layers[layer_idx].output  # reach this block first: by then `source` exists
            hidden[:, position] = source
            logits = parts.unembed.output[0, -1].save()
    return (logits[answer_ids[1]] - logits[answer_ids[0]]).item()


def baseline_logit_diffs(model: Any, parts: Any, clean: str, corrupt: str, answer_ids: tuple[int, int]) -> list[float]:
    """The logit difference of the clean and of the corrupted run, unpatched, in one trace."""
    with model.trace() as tracer:
        with tracer.invoke(clean):
            clean_logits = parts.unembed.output[0, -1].save()
        with tracer.invoke(corrupt):
            corrupt_logits = parts.unembed.output[0, -1].save()
    return [(logits[answer_ids[1]] - logits[answer_ids[0]]).item() for logits in (clean_logits, corrupt_logits)]


def patching_sweep(
    model: Any, parts: Any, clean: str, corrupt: str, answer_ids: tuple[int, int], num_tokens: int, num_workers: int
) -> torch.Tensor:
    """Raw patched logit differences, `[num_layers, num_tokens]`, one trace per cell from `num_workers` threads."""
    cells = [(layer_idx, position) for layer_idx in range(len(parts.layers)) for position in range(num_tokens)]
    with ThreadPoolExecutor(num_workers) as pool:
        futures = [pool.submit(patched_logit_diff, model, parts, clean, corrupt, answer_ids, *cell) for cell in cells]
        values = [future.result() for future in futures]
    return torch.tensor(values).reshape(len(parts.layers), num_tokens)  # [num_layers, num_tokens]


def plot(scores: torch.Tensor, labels: list[str], title: str, path: str) -> None:
    """Save the sweep as an annotated block x position heatmap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_layers, num_tokens = scores.shape
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * num_tokens, 1.2 + 0.5 * num_layers))
    image = ax.imshow(scores, cmap="Blues", vmin=0, vmax=1, aspect="auto", origin="lower")
    for (layer_idx, position), value in zip(
        torch.cartesian_prod(torch.arange(num_layers), torch.arange(num_tokens)), scores.flatten().tolist()
    ):
        ax.text(
            position,
            layer_idx,
            f"{round(value, 2) + 0.0:.2f}",
            ha="center",
            va="center",
            fontsize=8,
            color="white" if value > 0.6 else "black",
        )
    ax.set_xticks(range(num_tokens), labels, rotation=45, ha="right")
    ax.set_yticks(range(num_layers), [str(i) for i in range(num_layers)])
    ax.set_xlabel("patched position (clean prompt's token)")
    ax.set_ylabel("block (its output is patched)")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="patching effect")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--clean", default="The Louvre Museum is in")
    arguments.add_argument("--clean-answer", default=" Paris")
    arguments.add_argument("--corrupt", default="The Capitoline Museum is in")
    arguments.add_argument("--corrupt-answer", default=" Rome")
    arguments.add_argument("--workers", type=int, default=16, help="threads submitting traces")
    arguments.add_argument("--plot", metavar="PATH", help="save the heatmap as a PNG here")
    args = arguments.parse_args()

    model = nnrun.LanguageModel(args.model, device=args.device)
    tokenizer = model.tokenizer
    parts = find_layout(model)
    clean_ids, corrupt_ids = (tokenizer(p)["input_ids"] for p in (args.clean, args.corrupt))
    if len(clean_ids) != len(corrupt_ids):
        raise SystemExit(
            f"the prompts must have the same number of tokens to patch position by position; "
            f"they have {len(clean_ids)} and {len(corrupt_ids)}"
        )
    answer_ids = (single_token_id(tokenizer, args.clean_answer), single_token_id(tokenizer, args.corrupt_answer))
    clean_diff, corrupt_diff = baseline_logit_diffs(model, parts, args.clean, args.corrupt, answer_ids)
    print(f"clean {args.clean!r}: logit({args.corrupt_answer!r}) - logit({args.clean_answer!r}) = {clean_diff:.2f}")
    print(f"corrupt {args.corrupt!r}: {corrupt_diff:.2f}\n")

    num_layers, num_tokens = len(parts.layers), len(clean_ids)
    start = time.perf_counter()
    raw = patching_sweep(model, parts, args.clean, args.corrupt, answer_ids, num_tokens, args.workers)
    elapsed = time.perf_counter() - start
    scores = (raw - clean_diff) / (corrupt_diff - clean_diff)  # [num_layers, num_tokens]; 0 clean, 1 corrupt
    print(f"patching sweep: {num_layers * num_tokens} traces on {args.workers} threads in {elapsed:.2f} s")

    labels = token_labels(tokenizer, clean_ids)
    width = max(6, *(len(label) + 1 for label in labels))
    print("block " + "".join(f"{label:>{width}}" for label in labels))
    for layer_idx in range(num_layers):
        row = scores[layer_idx].tolist()
        print(f"{layer_idx:>5} " + "".join(f"{round(value, 2) + 0.0:>{width}.2f}" for value in row))
    print()
    for layer_idx in range(num_layers):
        position = int(scores[layer_idx].argmax())
        print(
            f"block {layer_idx}: strongest at position {position} {labels[position]!r} "
            f"({scores[layer_idx, position]:.2f})"
        )
    if args.plot:
        plot(scores, labels, f"patching {args.corrupt!r} into {args.clean!r}", args.plot)
    model.shutdown()


if __name__ == "__main__":
    main()
