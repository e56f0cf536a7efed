"""Extract last-token activations of the facts table to disk, then fit linear probes on them, block by block.

`nnrun.extract` runs every prompt through the engine and stores the named modules' outputs at
each prompt's last token in safetensors shards; `nnrun.load_activations` reads them back. Two
probes are fitted per module, with 5-fold cross-validation: which relation a fact asks about,
and which country it is about (France for "The Eiffel Tower is in", "Lyon is a city in", ...).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from common import layout_paths, module_path, parser

import nnrun
from nnrun.assets import Fact, load_facts

MIN_EXAMPLES_PER_COUNTRY = 4  # fewer cannot be spread over the folds


def country_labels(facts: list[Fact]) -> list[str | None]:
    """The country each fact is about, where the facts table says (None elsewhere)."""
    city_to_country = {f.subject: f.answer.strip() for f in facts if f.relation == "city_country"}
    countries: list[str | None] = []
    for fact in facts:
        if fact.relation == "landmark_city":
            countries.append(city_to_country.get(fact.answer.strip()))
        elif fact.relation == "city_country":
            countries.append(fact.answer.strip())
        elif fact.relation in ("country_capital", "country_language"):
            countries.append(fact.subject)
        else:
            countries.append(None)
    counts = Counter(c for c in countries if c is not None)
    return [c if c is not None and counts[c] >= MIN_EXAMPLES_PER_COUNTRY else None for c in countries]


def extracted_modules(llm: nnrun.LLM) -> list[str]:
    """The input embeddings and every decoder block, by HF module path."""
    model = llm.model
    embed_path = module_path(model, model.get_input_embeddings())
    layers_path = layout_paths(model)[0]
    return [embed_path] + [f"{layers_path}.{i}" for i in range(len(model.get_submodule(layers_path)))]


def probe_accuracy(
    features: torch.Tensor, labels: torch.Tensor, num_folds: int = 5, ridge: float = 10.0, seed: int = 0
) -> tuple[float, torch.Tensor]:
    """Cross-validated accuracy of a ridge-regression linear classifier, and its held-out predictions.

    features: [num_examples, hidden]; labels: [num_examples] class indices. The folds are
    stratified: each class is spread over them round-robin after a seeded shuffle.
    """
    num_examples, hidden = features.shape
    num_classes = int(labels.max()) + 1
    shuffled = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed))
    by_class = shuffled[labels[shuffled].argsort(stable=True)]  # [num_examples]
    fold_of = torch.empty(num_examples, dtype=torch.long)
    fold_of[by_class] = torch.arange(num_examples) % num_folds
    predictions = torch.empty_like(labels)
    for fold in range(num_folds):
        is_test = fold_of == fold
        train_x = features[~is_test]
        mean, std = train_x.mean(0), train_x.std(0) + 1e-6
        x = (train_x - mean) / std  # [num_train, hidden]
        targets = F.one_hot(labels[~is_test], num_classes).float()  # [num_train, num_classes]
        prior = targets.mean(0)
        weights = torch.linalg.solve(x.T @ x + ridge * torch.eye(hidden), x.T @ (targets - prior))
        scores = ((features[is_test] - mean) / std) @ weights + prior  # [num_test, num_classes]
        predictions[is_test] = scores.argmax(dim=-1)
    return (predictions == labels).float().mean().item(), predictions


def fit_probes(store: Any, modules: list[str], label_names: dict[str, list[str | None]]) -> dict[str, list[float]]:
    """Accuracy of each task's probe on each module's last-token activations: {task: [per module]}."""
    accuracy: dict[str, list[float]] = {task: [] for task in label_names}
    for module in modules:
        features = torch.stack([store[i][module][0].float() for i in range(len(store))])  # [num_prompts, hidden]
        for task, names in label_names.items():
            rows = [i for i, name in enumerate(names) if name is not None]
            classes = sorted({names[i] for i in rows})
            labels = torch.tensor([classes.index(names[i]) for i in rows])
            accuracy[task].append(probe_accuracy(features[rows], labels)[0])
    return accuracy


def plot(modules: list[str], accuracy: dict[str, list[float]], chance: dict[str, float], path: str) -> None:
    """Save each probe's accuracy per module, with its majority-class baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (task, values), color in zip(accuracy.items(), ("tab:blue", "tab:orange")):
        ax.plot(range(len(modules)), values, marker="o", color=color, label=f"{task} probe")
        ax.axhline(chance[task], color=color, linestyle=":", label=f"{task}: majority class")
    ax.set_xticks(range(len(modules)), modules, rotation=30, ha="right")
    ax.set_xlabel("module (activation at the prompt's last token)")
    ax.set_ylabel("5-fold cross-validated accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title("linear probes on the facts table")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--out-dir", help="extraction folder (default: a temporary one); an existing one resumes")
    arguments.add_argument("--plot", metavar="PATH", help="save accuracy per module as a PNG here")
    args = arguments.parse_args()

    facts = load_facts()
    label_names = {"relation": [f.relation for f in facts], "country": country_labels(facts)}
    with nnrun.LLM(args.model, device=args.device) as llm, tempfile.TemporaryDirectory() as scratch:
        modules = extracted_modules(llm)
        out_dir = args.out_dir or scratch
        summary = nnrun.extract(llm, [f.prompt for f in facts], modules, out_dir, positions="last")
        store = nnrun.load_activations(out_dir)
        print(f"{store}\nprompt 0: {facts[0].prompt!r}, {modules[-1]} -> shape {tuple(store[0][modules[-1]].shape)}")
        accuracy = fit_probes(store, modules, label_names)

    chance = {}
    for task, names in label_names.items():
        counts = Counter(n for n in names if n is not None)
        chance[task] = max(counts.values()) / sum(counts.values())
        print(f"{task}: {sum(counts.values())} prompts, {len(counts)} classes, majority class {chance[task]:.2f}")
    print(f"\n{'module':<24}" + "".join(f"{task:>10}" for task in accuracy))
    for i, module in enumerate(modules):
        print(f"{module:<24}" + "".join(f"{values[i]:>10.2f}" for values in accuracy.values()))
    print(f"({summary.num_prompts} prompts, {summary.num_tokens} tokens extracted in {summary.elapsed_s:.1f} s)")
    if args.plot:
        plot(modules, accuracy, chance, args.plot)


if __name__ == "__main__":
    main()
