"""Logit lens: decode every block's residual output with the model's final norm and unembedding.

For each block and each position this prints the token the lens ranks first, and for the last
position how the probability of the final answer grows through the blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from common import find_layout, parser, token_labels

import nnrun


def logit_lens(model: Any, parts: Any, prompt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-1 ids and probabilities `[num_layers, num_tokens]`, and last-position probabilities `[num_layers, vocab]`."""
    with model.trace(prompt):
        top_ids, top_probs, last_probs = list().save(), list().save(), list().save()
        for layer in parts.layers:
            probs = parts.unembed(parts.norm(layer.output)).softmax(dim=-1)[0]  # [num_tokens, vocab]
            values, ids = probs.max(dim=-1)
            top_probs.append(values)
            top_ids.append(ids)
            last_probs.append(probs[-1])
    return (
        torch.stack(list(top_ids)).cpu(),
        torch.stack(list(top_probs)).float().cpu(),
        torch.stack(list(last_probs)).float().cpu(),
    )


def plot(
    top_ids: torch.Tensor, top_probs: torch.Tensor, tokenizer: Any, labels: list[str], title: str, path: str
) -> None:
    """Save the lens as a block x position heatmap, each cell annotated with its top token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_layers, num_tokens = top_ids.shape
    fig, ax = plt.subplots(figsize=(1.2 + 0.95 * num_tokens, 1.2 + 0.55 * num_layers))
    image = ax.imshow(top_probs, cmap="viridis", vmin=0, vmax=1, aspect="auto", origin="lower")
    for layer_idx in range(num_layers):
        for position in range(num_tokens):
            text = token_labels(tokenizer, [int(top_ids[layer_idx, position])])[0]
            color = "black" if top_probs[layer_idx, position] > 0.6 else "white"
            ax.text(position, layer_idx, text, ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(num_tokens), labels, rotation=45, ha="right")
    ax.set_yticks(range(num_layers), [str(i) for i in range(num_layers)])
    ax.set_xlabel("input position (token)")
    ax.set_ylabel("block (its output, decoded)")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="probability of the top token")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--prompt", default="The Eiffel Tower is in")
    arguments.add_argument("--plot", metavar="PATH", help="save the heatmap of top tokens as a PNG here")
    args = arguments.parse_args()

    model = nnrun.LanguageModel(args.model, device=args.device)
    tokenizer = model.tokenizer
    parts = find_layout(model)
    top_ids, top_probs, last_probs = logit_lens(model, parts, args.prompt)
    labels = token_labels(tokenizer, tokenizer(args.prompt)["input_ids"])

    print(f"logit lens on {args.prompt!r}: the top token of each block's output, per input position")
    width = max(10, *(len(label) + 1 for label in labels))
    print("block " + "".join(f"{label:>{width}}" for label in labels))
    for layer_idx in range(len(parts.layers)):
        words = token_labels(tokenizer, top_ids[layer_idx].tolist())
        print(f"{layer_idx:>5} " + "".join(f"{word[: width - 1]:>{width}}" for word in words))

    answer_id = int(last_probs[-1].argmax())
    print(f"\nthe model's answer is {tokenizer.decode([answer_id])!r}; at the last position, by block:")
    for layer_idx, probs in enumerate(last_probs):
        top = int(probs.argmax())
        print(
            f"   block {layer_idx}: p(answer) {probs[answer_id]:.3f}, top {tokenizer.decode([top])!r} {probs[top]:.3f}"
        )
    if args.plot:
        plot(top_ids, top_probs, tokenizer, labels, f"logit lens on {args.prompt!r}", args.plot)
    model.shutdown()


if __name__ == "__main__":
    main()
