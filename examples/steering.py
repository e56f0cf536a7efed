"""Steering: a vector from contrasting prompts, added to a block's output at every step of generation.

The vector is the mean difference of the last-token residual state between prompts about Italy
and the same prompts about France. Adding it while generating from prompts about France moves
their answers toward Italy; a prompt about something else keeps its answer.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from common import find_layout, parser, single_token_id

import nnrun

# (toward, away from): the same question about Italy and about France.
CONTRAST_PAIRS = [
    ("The capital of Italy is", "The capital of France is"),
    ("The official language of Italy is", "The official language of France is"),
    ("Rome is a city in", "Paris is a city in"),
    ("Milan is a city in", "Lyon is a city in"),
    ("The Colosseum is in", "The Eiffel Tower is in"),
    ("The Trevi Fountain is in", "The Arc de Triomphe is in"),
]
# (prompt, its answer, the answer about Italy); the last one is a control, unrelated to countries.
TEST_PROMPTS = [
    ("The Louvre Museum is in", " Paris", " Rome"),
    ("The capital of France is", " Paris", " Rome"),
    ("The official language of France is", " French", " Italian"),
    ("Lyon is a city in", " France", " Italy"),
    ("Claude Monet was a famous", " painter", " painter"),
]
# tracer.all() asks for steps until the request stops, so nnsight notes that its last ask was
# never reached and that code after the loop did not run; here nothing follows the loop.
warnings.filterwarnings("ignore", message=r".*was never reached")


def steering_vector(model: Any, parts: Any, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """Mean last-token difference (toward - away) of every block's output: `[num_layers, hidden]`."""
    with model.trace() as tracer:
        states = list().save()
        for prompt in [toward for toward, _ in pairs] + [away for _, away in pairs]:
            with tracer.invoke(prompt):
                states.append(torch.stack([layer.output[0, -1] for layer in parts.layers]))
    states = torch.stack(list(states))  # [2 * num_pairs, num_layers, hidden]
    return states[: len(pairs)].mean(0) - states[len(pairs) :].mean(0)


def generate(
    model: Any, parts: Any, prompt: str, max_new_tokens: int, layer_idx: int, vector: torch.Tensor | None
) -> str:
    """Greedy continuation of `prompt`, with `vector` added to block `layer_idx`'s output at every step."""
    with model.generate(prompt, max_new_tokens=max_new_tokens) as tracer:
        new_ids = list().save()
        for _ in tracer.all():  # every forward of this request: the prompt's, then one per new token
            if vector is not None:
                parts.layers[layer_idx].output[:] += vector
            new_ids.append(model.samples)  # [1]: the token this step picked
    return model.tokenizer.decode(torch.cat(list(new_ids)), skip_special_tokens=True)


def answer_probs_by_scale(
    model: Any, parts: Any, layer_idx: int, vector: torch.Tensor, scales: list[float]
) -> torch.Tensor:
    """p(target answer) of each test prompt's next token at each scale, in one trace: `[num_prompts, num_scales]`."""
    tokenizer = model.tokenizer
    with model.trace() as tracer:
        probs = list().save()
        for prompt, _, italy_answer in TEST_PROMPTS:
            answer_id = single_token_id(tokenizer, italy_answer)
            for scale in scales:
                with tracer.invoke(prompt):
                    parts.layers[layer_idx].output[:] += scale * vector
                    probs.append(parts.unembed.output[0, -1].softmax(dim=-1)[answer_id])
    return torch.stack(list(probs)).reshape(len(TEST_PROMPTS), len(scales))


def plot(scales: list[float], probs: torch.Tensor, layer_idx: int, path: str) -> None:
    """Save p(target answer) against the steering scale, one line per test prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (prompt, answer, italy_answer), row in zip(TEST_PROMPTS, probs.tolist()):
        control = " (control: its own answer)" if answer == italy_answer else ""
        ax.plot(
            scales,
            row,
            marker="o",
            linestyle="--" if control else "-",
            label=f"{prompt!r} -> {italy_answer!r}{control}",
        )
    ax.set_xlabel(f"steering scale (multiple of the vector, added at block {layer_idx})")
    ax.set_ylabel("probability of the target answer")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("steering France -> Italy: the first generated token")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--layer", type=int, help="block whose output is steered (default: the middle one)")
    arguments.add_argument("--scale", type=float, default=2.0, help="multiple of the steering vector to add")
    arguments.add_argument("--max-new-tokens", type=int, default=10)
    arguments.add_argument("--plot", metavar="PATH", help="save p(answer about Italy) against the scale as a PNG")
    args = arguments.parse_args()

    model = nnrun.LanguageModel(args.model, device=args.device)
    parts = find_layout(model)
    layer_idx = len(parts.layers) // 2 if args.layer is None else args.layer
    vectors = steering_vector(model, parts, CONTRAST_PAIRS)  # [num_layers, hidden]
    vector = args.scale * vectors[layer_idx]
    print(
        f"steering vector from {len(CONTRAST_PAIRS)} contrast pairs; norm per block: "
        + ", ".join(f"{norm:.1f}" for norm in vectors.norm(dim=-1).tolist())
    )
    print(f"adding {args.scale} x the vector to block {layer_idx}'s output at every generated token\n")
    for prompt, _, _ in TEST_PROMPTS:
        plain = generate(model, parts, prompt, args.max_new_tokens, layer_idx, None)
        steered = generate(model, parts, prompt, args.max_new_tokens, layer_idx, vector)
        print(f"{prompt!r}\n   without: {plain!r}\n   steered: {steered!r}")
    if args.plot:
        scales = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0]
        plot(scales, answer_probs_by_scale(model, parts, layer_idx, vectors[layer_idx], scales), layer_idx, args.plot)
    model.shutdown()


if __name__ == "__main__":
    main()
