"""One family in bf16 on nnrun against HF's own bf16, at lengths where rounded RoPE frequencies would show.

The oracle is plain HF: the family's tiny checkpoint (weights at initializer_range 0.2, so that logits
are far from uniform) loaded by `from_pretrained(dtype=torch.bfloat16)`, each sequence run alone.
nnrun loads the same folder in bf16 and generates greedily from prompts of 256 and 300 tokens, both
prompts packed in one engine call and each alone, returning every position's full log-probabilities.
Each must be within HF's own rounding of HF alone: `ROUNDING_FACTOR` times how far HF's own
log-probabilities move between a right-padded batch of the prompts and each alone, or between its
decode steps on its own cache (`generate`) and without one (at least one bf16 step of HF's largest
logit). MoE families must route every token to HF's experts: the expert
indices each `*experts` module is called with (transformers' shared experts interface) are compared
token by token.
"""

from __future__ import annotations

import inspect
import math
import tempfile
import warnings
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM

from families.tiny import VOCAB_SIZE, tiny_config

PROMPT_LENGTHS = (256, 300)
NUM_DECODE_STEPS = 3
MAX_POSITIONS = 512
ROUNDING_FACTOR = 2.0
DTYPE = torch.bfloat16


@dataclass
class HalfPrecisionResult:
    model_type: str
    path: str  # "packed", "exact", "refused" or "not built"
    detail: str = ""
    errors: dict[str, float] = field(default_factory=dict)  # "packed"/"alone" -> largest |log-prob| error vs HF alone
    bound: float = 0.0
    hf_spread: float = 0.0  # HF's own rounding: its right-padded batch, and its cached decode, against alone
    num_routed_tokens: int = 0  # token-layer expert choices compared (0: not an MoE on the shared interface)


def check_half_precision(model_type: str) -> HalfPrecisionResult:
    """Raises AssertionError if nnrun's bf16 numbers or expert choices are not HF's to HF's own rounding."""
    import nnrun
    from nnrun.exact import ModelRefusedError

    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as folder:
        warnings.simplefilter("ignore")
        try:
            hf = _hf_checkpoint(model_type, folder)
            prompts = _prompts(hf)
            vocab = _vocab(hf, prompts[0])  # HF's own bf16 forward runs a long prompt
        except Exception as error:
            return HalfPrecisionResult(model_type, "not built", f"{type(error).__name__}: {error}"[:300])
        params = nnrun.SamplingParams(
            max_tokens=NUM_DECODE_STEPS, temperature=0, ignore_eos=True, logprobs=vocab, prompt_logprobs=vocab
        )
        try:
            llm = nnrun.LLM(folder, dtype=DTYPE, max_model_len=MAX_POSITIONS, max_num_batched_tokens=1024)
        except ModelRefusedError as error:
            assert model_type in str(error), f"the refusal does not name the family: {error}"
            return HalfPrecisionResult(model_type, "refused", str(error)[:300])
        with llm:
            path = "packed" if llm.runner.exact_forward is None else "exact"
            routes = ExpertRoutes(llm.model)
            packed = llm.generate(prompts, params)
            packed_routes = routes.take()
            alone = [llm.generate([prompt], params)[0] for prompt in prompts]
            alone_routes = [routes.take()]
            routes.remove()
    sequences = [prompt + list(output.outputs[0].token_ids) for prompt, output in zip(prompts, packed)]
    hf_alone, hf_alone_routes, hf_spread, max_logit = _hf_oracle(hf, sequences)
    ulp = 2.0 ** (math.floor(math.log2(max_logit)) - 7) if max_logit > 0 else 0.0  # bf16: 8 significant bits
    result = HalfPrecisionResult(model_type, path, bound=ROUNDING_FACTOR * max(hf_spread, ulp), hf_spread=hf_spread)
    for name, outputs in (("packed", packed), ("alone", alone)):
        errors = [float((_log_probs(o, p, vocab) - ref).abs().max()) for o, p, ref in zip(outputs, prompts, hf_alone)]
        result.errors[name] = max(errors)
        assert result.errors[name] <= result.bound, (
            f"{model_type} ({path}, {name}): bf16 log-probs off HF alone by {result.errors[name]:.3g}, "
            f"over {ROUNDING_FACTOR} x HF's own rounding ({hf_spread:.3g} padded vs alone, one bf16 step {ulp:.3g})"
        )
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        assert tokens == [s[len(p) :] for s, p in zip(sequences, prompts)], f"{model_type} ({name}): tokens differ"
    lengths = [len(s) - 1 for s in sequences]  # the tokens nnrun ran: each prompt and all but its last token
    result.num_routed_tokens = _check_routes(
        model_type, "packed", _packed_order(packed_routes, lengths, path), hf_alone_routes
    )
    _check_routes(model_type, "alone", _alone_order(alone_routes[0], lengths), hf_alone_routes)
    return result


class ExpertRoutes:
    """The expert indices `[tokens, k]` every `*experts` module of a model is called with, per module, in call order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: dict[str, list[torch.Tensor]] = {}
        self.handles = [
            module.register_forward_pre_hook(self._hook(name), with_kwargs=True)
            for name, module in model.named_modules()
            if name.endswith("experts")
        ]

    def _hook(self, name: str):
        def record(module, args, kwargs):
            indices = [
                a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and not a.is_floating_point()
            ]
            if indices and indices[0].dim() >= 2:
                self.calls.setdefault(name, []).append(indices[0].reshape(-1, indices[0].shape[-1]).cpu())

        return record

    def take(self) -> dict[str, list[torch.Tensor]]:
        calls, self.calls = self.calls, {}
        return calls

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _hf_checkpoint(model_type: str, folder: str) -> torch.nn.Module:
    """The family's tiny model saved fp32 to `folder`, and HF's own bf16 load of it."""
    config = tiny_config(model_type)
    for sub in [config] + [getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {}]:
        if sub is None:
            continue
        if isinstance(getattr(sub, "initializer_range", None), float):
            sub.initializer_range = 0.2
        for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions"):
            if isinstance(getattr(sub, name, None), int):
                setattr(sub, name, MAX_POSITIONS)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE).eval()


def _prompts(model: torch.nn.Module) -> list[list[int]]:
    config = model.config
    special: set[int] = set()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        special.update(value if isinstance(value, list) else [value])
    pool = torch.tensor([t for t in range(VOCAB_SIZE) if t not in special])
    generator = torch.Generator().manual_seed(1)
    return [pool[torch.randint(len(pool), (n,), generator=generator)].tolist() for n in PROMPT_LENGTHS]


def _vocab(model: torch.nn.Module, prompt: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([prompt])).logits.shape[-1])


def _log_probs(output, prompt: list[int], vocab: int) -> torch.Tensor:
    """nnrun's `[T + n - 1, V]` log-probabilities: of each prompt token after the first, then of each generated one."""
    rows = output.prompt_logprobs[1 : len(prompt)] + list(output.outputs[0].logprobs)
    return torch.tensor([[row[v] for v in range(vocab)] for row in rows])


@torch.no_grad()
def _hf_oracle(model: torch.nn.Module, sequences: list[list[int]]):
    """HF alone per sequence (`[L - 1, V]` log-probs, expert routes), HF's padded-vs-alone spread, its largest logit.

    As HF generates without a cache (`_from_scratch`): the prompt's forward, then one forward of the sequence
    so far per decode step, its last position (a model that is not causal sees only the tokens so far, as on nnrun).
    """
    takes = set(inspect.signature(model.forward).parameters)
    no_cache = _from_scratch(model, takes, sequences[0][: len(sequences[0]) - NUM_DECODE_STEPS])
    routes = ExpertRoutes(model)
    alone, alone_routes, max_logit = [], [], 0.0
    for sequence in sequences:
        num_prompt = len(sequence) - NUM_DECODE_STEPS
        logits = [model(input_ids=torch.tensor([sequence[:num_prompt]]), **no_cache).logits[0].float()]  # [T, V]
        prompt_routes = routes.take()
        for end in range(num_prompt + 1, len(sequence)):
            logits.append(model(input_ids=torch.tensor([sequence[:end]]), **no_cache).logits[0, -1:].float())  # [1, V]
        decode_routes = routes.take()
        logits = torch.cat(logits)  # [L - 1, V]
        alone.append(torch.log_softmax(logits, dim=-1))
        max_logit = max(max_logit, float(logits.abs().max()))
        alone_routes.append(
            {
                name: torch.cat([calls[0]] + [step[-1:] for step in decode_routes[name]])
                for name, calls in prompt_routes.items()
            }
        )
    routes.remove()
    prompts = [s[: len(s) - NUM_DECODE_STEPS] for s in sequences]
    spread = max(_padded_spread(model, prompts, alone, takes), _cached_spread(model, sequences, alone))
    return alone, alone_routes, spread, max_logit


def _from_scratch(model: torch.nn.Module, takes: set, prompt: list[int]) -> dict:
    """The keywords of HF's forward of a whole sequence from no state: no cache, or a fresh cache of its own.

    The second where HF's forward fails without one: xLSTM in half precision, whose chunkwise kernel cannot
    mix its float32 start state with half-precision keys, runs only from its cache's states, in the model's dtype.
    """
    if "use_cache" not in takes:
        return {}
    try:
        model(input_ids=torch.tensor([prompt]), use_cache=False)
    except RuntimeError:
        return {"use_cache": True}
    return {"use_cache": False}


def _padded_spread(model: torch.nn.Module, prompts: list[list[int]], alone: list[torch.Tensor], takes: set) -> float:
    """How far HF's prompt log-probs move in one right-padded batch of the prompts against each alone (HF's rounding)."""
    longest = max(len(p) for p in prompts)
    rows = torch.tensor([p + [p[0]] * (longest - len(p)) for p in prompts])  # [B, T]
    kwargs = {"use_cache": False} if "use_cache" in takes else {}
    if "attention_mask" in takes:
        lengths = torch.tensor([len(p) for p in prompts])  # [B]
        kwargs["attention_mask"] = (torch.arange(longest)[None] < lengths[:, None]).long()  # [B, T]
    try:
        batch = torch.log_softmax(model(input_ids=rows, **kwargs).logits.float(), dim=-1)  # [B, T, V]
    except Exception:  # a family whose batched forward fails: one bf16 step is its rounding
        return 0.0
    return max(float((batch[i, : len(p)] - alone[i][: len(p)]).abs().max()) for i, p in enumerate(prompts))


def _cached_spread(model: torch.nn.Module, sequences: list[list[int]], alone: list[torch.Tensor]) -> float:
    """How far HF's decode steps on its own cache (`generate`) move against its forwards without one (HF's rounding).

    Compared where HF's greedy tokens so far are the sequence's; 0 where HF's `generate` cannot run the family.
    """
    spread = 0.0
    for sequence, expected in zip(sequences, alone):
        num_prompt = len(sequence) - NUM_DECODE_STEPS
        try:
            out = model.generate(
                torch.tensor([sequence[:num_prompt]]),
                max_new_tokens=NUM_DECODE_STEPS,
                min_new_tokens=NUM_DECODE_STEPS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        except Exception:
            return spread
        tokens = out.sequences[0, num_prompt:].tolist()
        for step, logits in enumerate(out.logits[1:], start=1):  # step 0 is the prompt's forward: no cache yet
            if tokens[:step] != sequence[num_prompt : num_prompt + step]:
                break
            row = torch.log_softmax(logits[0].float(), dim=-1)  # [V]
            spread = max(spread, float((row - expected[num_prompt - 1 + step]).abs().max()))
    return spread


def _packed_order(calls: dict[str, list[torch.Tensor]], lengths: list[int], path: str) -> list[dict[str, torch.Tensor]]:
    """Per sequence, per module: its tokens' routes from the engine call of all sequences together.

    Each step holds every sequence: on the packed path one call whose rows go in batch order (the
    prefill's prompts, then a row per sequence at each decode step); on the exact path one call per
    sequence, in batch order.
    """
    num_seqs = len(lengths)
    per_sequence: list[dict[str, torch.Tensor]] = [{} for _ in lengths]
    for name, steps in calls.items():
        if path == "exact":
            steps = [torch.cat(steps[start : start + num_seqs]) for start in range(0, len(steps), num_seqs)]
        prefill = steps[0].split([n - NUM_DECODE_STEPS + 1 for n in lengths])
        for i, part in enumerate(prefill):
            per_sequence[i][name] = torch.cat([part] + [step[i : i + 1] for step in steps[1:]])
    return per_sequence


def _alone_order(calls: dict[str, list[torch.Tensor]], lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per sequence, per module: the routes of its engine call alone (prefill, then its decode steps)."""
    num_calls = NUM_DECODE_STEPS  # a prefill and NUM_DECODE_STEPS - 1 decode steps per sequence
    return [
        {name: torch.cat(steps[i * num_calls : (i + 1) * num_calls]) for name, steps in calls.items()}
        for i in range(len(lengths))
    ]


def _check_routes(model_type: str, name: str, ours: list[dict], hf: list[dict]) -> int:
    """Asserts every token's expert set is HF's in every routed layer; the number of token-layer choices compared."""
    compared = 0
    for i, (mine, theirs) in enumerate(zip(ours, hf)):
        assert mine.keys() == theirs.keys(), f"{model_type} ({name}): routed modules {sorted(mine)} != {sorted(theirs)}"
        for module, expected in theirs.items():
            got = mine[module]
            assert got.shape == expected.shape, f"{model_type} ({name}) {module}: {tuple(got.shape)} routes"
            differing = (got.sort(dim=-1).values != expected.sort(dim=-1).values).any(dim=-1).nonzero().flatten()
            assert not len(differing), (
                f"{model_type} ({name}) {module}: sequence {i}'s tokens {differing.tolist()[:8]} go to other experts "
                "than HF's"
            )
            compared += expected.shape[0]
    return compared
