"""Interventions during generation (issue 35's rows), shared by `interventions.py` (CPU) and `gpu.py` (GPU).

Every row generates the same prompts, greedy, exactly `new_tokens` each, one invoke per prompt:

  engine.generate                  the engine alone, no trace
  traced, nothing inside           `model.generate` with empty invokes
  one layer saved every step       `tracer.all()` appending `layers[L].output` to a saved list
  last row of one layer            the same, `layers[L].output[:, -1]`
  all layers saved every step      every layer's output, every step
  steering vector every step       `layers[L].output[:] += vector` under `tracer.all()`
  prefill trace                    no generation: one `model.trace()`, the layer's output saved per invoke
  engine prefill alone             the prefill trace's floor: `engine.generate` of the prompts, one new token each
  HF generate                      one left-padded batch on the same weights
  nnsight on HF, ...               the traced rows' nnsight code on nnsight's own LanguageModel

Each row runs once untimed, then `repeats` rounds of every row in turn; a row's time is its best
round (load on a shared machine only ever adds time): wall time on a GPU, the process's CPU time on
a CPU, where other jobs' load would swamp the wall clock. The cost per saved value is the time a saving
row adds to the empty trace, divided by the values it saves: (request, module, step) triples.

No trace can beat the untraced engine on the same prompts, so nnsight on HF's prefill trace over
"engine prefill alone" is the best ratio the prefill trace can reach (its ceiling): nnsight on HF pads
every prompt to the longest, the engine packs them, and both are compute-bound on a GPU. The table
prints it as the floor row's "nnsight on HF / this", and next to the prefill trace's own ratio.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from common import left_padded


@dataclass
class GenerationSetup:
    """The prompts (text for the traces, ids for `engine.generate` and HF) and what the traces touch."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    new_tokens: int
    layer: int  # the layer the one-layer rows read or steer
    num_layers: int
    vector: torch.Tensor  # [H] the steering vector, on the model's device and dtype

    @classmethod
    def for_model(
        cls, config: Any, prompt_ids: list[list[int]], new_tokens: int, device: Any = None, dtype: Any = None
    ) -> GenerationSetup:
        """The rows' setup for a model of `config`: its middle layer, and a fixed ramp as the steering vector."""
        return cls(
            prompts=word_prompts(prompt_ids),
            prompt_ids=prompt_ids,
            new_tokens=new_tokens,
            layer=config.num_hidden_layers // 2,
            num_layers=config.num_hidden_layers,
            vector=torch.linspace(-0.5, 0.5, config.hidden_size, device=device, dtype=dtype),
        )

    @property
    def num_values(self) -> int:
        """(request, step) pairs of one generation: one saved value per layer read."""
        return len(self.prompts) * self.new_tokens


def word_prompts(prompt_ids: list[list[int]]) -> list[str]:
    """Text that `word_tokenizer` turns back into exactly `prompt_ids`."""
    return [" ".join(f"w{token}" for token in ids) for ids in prompt_ids]


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer whose word `w<i>` is token i (ids 0-2: pad, unk, unused), left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {"<pad>": 0, "<unk>": 1, "<unused>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    tokenizer.padding_side = "left"
    return tokenizer


# ---- the traced workloads: plain nnsight code, the same on nnrun and on nnsight + HF ----------
@torch.no_grad()
def traced_nothing(model: Any, s: GenerationSetup) -> None:
    with model.generate(max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens, do_sample=False) as tracer:
        for text in s.prompts:
            with tracer.invoke(text):
                pass


@torch.no_grad()
def save_one_layer(model: Any, s: GenerationSetup) -> list:
    with model.generate(max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens, do_sample=False) as tracer:
        saved = list().save()
        for text in s.prompts:
            with tracer.invoke(text):
                for _ in tracer.all():
                    saved.append(model.model.layers[s.layer].output)
    return saved


@torch.no_grad()
def save_last_row(model: Any, s: GenerationSetup) -> list:
    with model.generate(max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens, do_sample=False) as tracer:
        saved = list().save()
        for text in s.prompts:
            with tracer.invoke(text):
                for _ in tracer.all():
                    saved.append(model.model.layers[s.layer].output[:, -1])
    return saved


@torch.no_grad()
def save_all_layers(model: Any, s: GenerationSetup) -> list:
    with model.generate(max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens, do_sample=False) as tracer:
        saved = list().save()
        for text in s.prompts:
            with tracer.invoke(text):
                for _ in tracer.all():
                    for layer in range(s.num_layers):
                        saved.append(model.model.layers[layer].output)
    return saved


@torch.no_grad()
def steer(model: Any, s: GenerationSetup) -> None:
    with model.generate(max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens, do_sample=False) as tracer:
        for text in s.prompts:
            with tracer.invoke(text):
                for _ in tracer.all():
                    model.model.layers[s.layer].output[:] += s.vector


@torch.no_grad()
def prefill_trace(model: Any, s: GenerationSetup) -> list:
    """No generation: one trace over every prompt as its own invoke, saving the layer's output."""
    saved = []
    with model.trace() as tracer:
        for text in s.prompts:
            with tracer.invoke(text):
                saved.append(model.model.layers[s.layer].output.save())
    return saved


PREFILL_TRACE = "prefill trace, one layer read per invoke"
PREFILL_FLOOR = "engine prefill alone"  # untraced: no prefill trace can be faster (its ceiling vs nnsight on HF)
TRACED = {
    "traced, nothing inside": traced_nothing,
    "one layer saved every step": save_one_layer,
    "last row of one layer saved every step": save_last_row,
    "all layers saved every step": save_all_layers,
    "steering vector every step": steer,
    PREFILL_TRACE: prefill_trace,
}
NNSIGHT_ROWS = (
    "traced, nothing inside",
    "one layer saved every step",
    "steering vector every step",
    PREFILL_TRACE,
)


@torch.no_grad()
def engine_generate(llm: Any, s: GenerationSetup) -> None:
    import nnrun

    # The traced rows' decoding exactly: min_new_tokens = max_new_tokens masks EOS until the last token
    # (ignore_eos would skip that mask, and the ratios would compare different steps).
    params = nnrun.SamplingParams(max_tokens=s.new_tokens, min_tokens=s.new_tokens, temperature=0)
    llm.generate(s.prompt_ids, params)


@torch.no_grad()
def engine_prefill(llm: Any, s: GenerationSetup) -> None:
    """The prefill trace's floor: the same prompts through the engine alone, one greedy token each (no trace)."""
    import nnrun

    llm.generate(s.prompt_ids, nnrun.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))


@torch.no_grad()
def hf_generate(model: torch.nn.Module, s: GenerationSetup) -> None:
    ids, mask = left_padded(s.prompt_ids)
    model.generate(
        ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=s.new_tokens,
        min_new_tokens=s.new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


def workloads(
    ours: Any, oracle: Any | None, hf_model: torch.nn.Module | None, s: GenerationSetup, nnsight_all: bool = False
) -> dict[str, Callable[[], object]]:
    """Row name -> thunk. `ours`: nnrun's LanguageModel; `oracle`: nnsight's on the same weights (None: no rows)."""
    rows: dict[str, Callable[[], object]] = {"engine.generate": lambda: engine_generate(ours.engine, s)}
    rows.update({name: (lambda fn=fn: fn(ours, s)) for name, fn in TRACED.items()})
    rows[PREFILL_FLOOR] = lambda: engine_prefill(ours.engine, s)
    if hf_model is not None:
        rows["HF generate"] = lambda: hf_generate(hf_model, s)
    if oracle is not None:
        for name in TRACED if nnsight_all else NNSIGHT_ROWS:
            rows[f"nnsight on HF, {name}"] = lambda fn=TRACED[name]: fn(oracle, s)
    return rows


def best_times(
    rows: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None] = lambda: None, cpu: bool = False
) -> dict[str, float]:
    """Best seconds of each row over `repeats` rounds, every row once per round (after one untimed run each).

    `cpu`: the process's CPU seconds (every thread's) instead of wall time: on a CPU shared with other
    jobs, wall time mostly measures their load, while CPU time is the work this process did.
    """
    clock = time.process_time if cpu else time.perf_counter
    for run in rows.values():
        run()
    best = {name: math.inf for name in rows}
    for _ in range(repeats):
        for name, run in rows.items():
            sync()
            start = clock()
            run()
            sync()
            best[name] = min(best[name], clock() - start)
    return best


def report(seconds: dict[str, float], s: GenerationSetup) -> list[dict]:
    """One dict per row: seconds, / the engine, nnsight on HF's time over ours, µs per saved value; the prefill
    trace's row also has its ceiling (nnsight on HF's prefill trace over the engine's prefill alone)."""
    engine = seconds["engine.generate"]
    nothing = seconds["traced, nothing inside"]
    nnsight_prefill = seconds.get(f"nnsight on HF, {PREFILL_TRACE}")
    floor = seconds.get(PREFILL_FLOOR)
    ceiling = None if nnsight_prefill is None or floor is None else nnsight_prefill / floor
    per_value = {
        "one layer saved every step": s.num_values,
        "last row of one layer saved every step": s.num_values,
        "all layers saved every step": s.num_values * s.num_layers,
    }
    rows = []
    for name, secs in seconds.items():
        oracle = nnsight_prefill if name == PREFILL_FLOOR else seconds.get(f"nnsight on HF, {name}")
        values = per_value.get(name)
        rows.append(
            {
                "workload": name,
                "seconds": secs,
                "vs_engine": secs / engine,
                "nnsight_over_ours": None if oracle is None else oracle / secs,
                "us_per_value": None if values is None else (secs - nothing) / values * 1e6,
                "ceiling": ceiling if name == PREFILL_TRACE else None,
            }
        )
    return rows


def print_report(rows: list[dict], heading: str | None = "interventions") -> None:
    """A markdown table (under `## heading` when given)."""
    if heading:
        print(f"\n## {heading}\n")
    print("| workload | seconds | / engine | nnsight on HF / this | µs per saved value |\n|---|---|---|---|---|")
    for row in rows:
        oracle, per_value, ceiling = row["nnsight_over_ours"], row["us_per_value"], row.get("ceiling")
        versus = "-" if oracle is None else f"{oracle:.2f}x"
        if ceiling is not None:  # the best this row can reach: nnsight on HF / the engine's prefill alone
            versus += f" (ceiling {ceiling:.2f}x)"
        print(
            f"| {row['workload']} | {row['seconds']:.3f} | {row['vs_engine']:.2f}x | "
            f"{versus} | {'-' if per_value is None else f'{per_value:.1f}'} |"
        )
