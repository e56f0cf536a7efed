"""The load-time exactness probe: does the packed path give this model's own HF numbers?

First the model's dtypes are held against HF's own loading (`dtype_refusal`): a model cast
wholesale has rounded RoPE frequencies or fp32-kept weights, and HF's forward on it departs from
HF's own load as much as nnrun's would, so no comparison with it could tell.

Then a few short prompts of different lengths run packed in one step and then one decode step each;
every prompt's logits are compared with the model's own HF forward of that prompt alone (HF's own
cache for the decode step). One more short prompt does the same at positions near
`min(max_model_len, 4096)` (through `position_ids`, where the family takes them), so that an error
growing with the position shows. Anything that differs, and the model never serves from the packed
path. The cost: two packed prefills and decodes, two HF forwards per prompt, and (only when
something differed, to say what) one packed prefill per prompt alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from nnrun.exact.hf_forward import HFForward
from nnrun.forward_batch import ForwardBatch, ForwardMode, packed_forward_batch
from nnrun.hf_dtypes import dtype_departures
from nnrun.memory import hold_kv

if TYPE_CHECKING:
    from nnrun.forward_path import PackedPath
    from nnrun.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PROBE_LENGTHS = (5, 11, 3)  # different lengths, so a packed request starts mid-batch and lengths differ
MAX_WINDOW_PROBED = 64  # a sliding window or attention chunk up to this long gets a prompt that crosses it
HIGH_POSITION_LENGTH = 8  # the prompt run at high positions (its own packed step)
MAX_POSITION_PROBED = 4096  # the high-position prompt ends (its decode token included) near min(max_model_len, this)


class ModelRefusedError(ValueError):
    """The model cannot run on nnrun at all (not even through its own HF forward)."""


@dataclass
class ProbePrompt:
    token_ids: list[int]
    next_token_id: int  # the token its decode step feeds
    first_position: int = 0  # the position of its first token (its `position_ids` start here)

    def describe(self) -> str:
        where = "" if not self.first_position else f" at positions {self.first_position}.."
        return f"{len(self.token_ids)}-token prompt{where}"


@dataclass(frozen=True)
class Reference:
    """HF's own logits for one probe prompt: every prefill position, then the decode step."""

    prefill: torch.Tensor  # [T, V]
    decode: torch.Tensor  # [V]
    # Half precision: how far HF's own prefill logits of this prompt move when HF computes them in a
    # right-padded batch of all the probe prompts (relative to their magnitude). Only rounding tells
    # the two apart, since no real token sees the padding after it: the model's own noise floor.
    batch_rounding: float = 0.0


ROUNDING_FACTOR = 3.0  # in half precision packed may differ from HF by this many times HF's own batch rounding


def relative_tolerance(dtype: torch.dtype, references: list[Reference] = ()) -> float:
    """How far packed logits may stray from HF's, relative to the largest logit of the prompt.

    fp32: summation order alone (a packed step sums rows in other groupings than one prompt).
    Half types: their rounding, compounded over the layers, which a deep model amplifies beyond any
    fixed bound (a 32-layer bf16 Llama-8B shape with random weights, on an H100: 4.3% between a prompt
    packed and alone, on the same kernels), so the bound grows with HF's own batch rounding.
    """
    if dtype == torch.float32:
        return 1e-3
    return max(2e-2, ROUNDING_FACTOR * max((r.batch_rounding for r in references), default=0.0))


def kernel_tolerance(dtype: torch.dtype, references: list[Reference] = ()) -> float:
    """The bound for the configured attention kernels (FlashInfer) against HF's sdpa on the same prompts.

    Two half-precision kernels round differently, each by about as much as half precision is off
    float32: on a 16-layer bf16 Llama (H100) HF's logits were 2.4% off an fp32 oracle and FlashInfer's
    decode 2.0% off HF's, while the torch backend gave HF's bits. Errors of the paged plan (a wrong
    page, a missing mask) move logits by far more than this.
    """
    if dtype == torch.float32:
        return 1e-3
    return max(6e-2, relative_tolerance(dtype, references))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest error relative to the expected values' magnitude (inf if the shapes differ)."""
    actual, expected = actual.float(), expected.float()
    if actual.shape != expected.shape:
        return float("inf")
    scale = float(expected.abs().max()) + 1e-6
    return float((actual - expected).abs().max()) / scale


def differs(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> float | None:
    """The largest error relative to the expected values' magnitude, if it is over `rtol`; else None."""
    error = relative_error(actual, expected)
    return error if not error <= rtol else None  # a NaN counts as differing


def probe_lengths(
    window: int | None, max_len: int, num_slots: int, page_size: int, max_prompts: int = len(PROBE_LENGTHS)
) -> list[int]:
    """The probe prompts' lengths: one crosses a short window if there is one; all fit the context and the KV pool.

    Each prompt needs room for its decode token; prompts are dropped from the end (to `max_prompts`,
    the request rows there are, and further), then shortened, until they fit `num_slots` KV slots of
    `page_size`-token pages.
    """
    lengths = list(PROBE_LENGTHS)[: max(1, max_prompts)]
    if window is not None and window + 2 <= MAX_WINDOW_PROBED:
        lengths[1] = max(lengths[1], window + 2)
    lengths = [max(1, min(n, max_len - 1)) for n in lengths]

    def slots(ns: list[int]) -> int:
        return sum(-(-(n + 1) // page_size) * page_size for n in ns)

    while len(lengths) > 1 and slots(lengths) > num_slots:
        lengths.pop()
    while lengths[0] > 1 and slots(lengths) > num_slots:
        lengths[0] -= 1
    return lengths


def probe_prompts(vocab_size: int, special_ids: set[int], lengths: list[int], seed: int = 0) -> list[ProbePrompt]:
    """Seeded token ids of these lengths, none of them a special token, each with its decode step's token."""
    pool = [t for t in range(min(vocab_size, 4096)) if t not in special_ids] or list(range(vocab_size))
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(pool), (sum(lengths) + len(lengths),), generator=generator).tolist()
    ids = [pool[i] for i in picks]
    prompts, start = [], 0
    for length in lengths:
        prompts.append(ProbePrompt(ids[start : start + length], ids[start + length]))
        start += length + 1
    return prompts


def high_position_prompt(
    vocab_size: int, special_ids: set[int], max_len: int, num_slots: int, page_size: int
) -> ProbePrompt | None:
    """A short prompt whose decode token lands at `min(max_len, MAX_POSITION_PROBED) - 1`, or None.

    None where the positions would not reach past the short prompts' or its KV would not fit.
    """
    first_position = min(max_len, MAX_POSITION_PROBED) - HIGH_POSITION_LENGTH - 1
    if first_position <= max(PROBE_LENGTHS) or -(-(HIGH_POSITION_LENGTH + 1) // page_size) * page_size > num_slots:
        return None
    prompt = probe_prompts(vocab_size, special_ids, [HIGH_POSITION_LENGTH], seed=1)[0]
    return replace(prompt, first_position=first_position)


def dtype_refusal(model: torch.nn.Module, dtype: torch.dtype, family: str) -> ModelRefusedError | None:
    """The refusal of a model whose tensors are not in the dtypes HF's own loading at `dtype` gives them."""
    try:
        departures = dtype_departures(model, dtype)
    except Exception as error:  # the class cannot be rebuilt from its config on the meta device: HF's rules unknown
        logger.warning(
            "%s: its dtypes were not checked against HF's loading (%s: %s)", family, type(error).__name__, error
        )
        return None
    if not departures:
        return None
    shown = "; ".join(departures[:3]) + (f"; and {len(departures) - 3} more" if len(departures) > 3 else "")
    name = str(dtype).removeprefix("torch.")
    return ModelRefusedError(
        f"{family}: {len(departures)} tensors are not in the dtype HF's own loading in {name} gives them ({shown}). "
        f"HF keeps RoPE frequencies and the class's keep-in-fp32 weights in float32; a model cast wholesale "
        f"(model.to(dtype), .half()) has them rounded, and its numbers drift from HF's as positions grow. Load it "
        f"with from_pretrained(..., dtype=torch.{name}), or give nnrun the float32 model with dtype=torch.{name} "
        f"(nnrun then serves a copy cast as HF's loading would: nnrun.hf_dtypes.cast_like_hf)"
    )


def hf_references(hf: HFForward, prompts: list[ProbePrompt], family: str) -> list[Reference]:
    """Each prompt alone through HF's own forward: its prefill, then one decode step on HF's cache.

    If HF's cache fails, HF's `use_cache=False` way (the whole sequence every step) is tried; a
    model whose own forward fails both ways cannot run on nnrun at all: refused, naming the family.
    """
    try:
        references = _references(hf, prompts)
    except Exception as error:
        if not hf.keeps_cache:
            raise _refusal(family, prompts, error) from error
        hf.keeps_cache, hf.cache_argument = False, None
        try:
            references = _references(hf, prompts)
        except Exception:
            raise _refusal(family, prompts, error) from error
    if hf.model.dtype == torch.float32:
        return references
    at_start = [i for i, prompt in enumerate(prompts) if not prompt.first_position]  # one padded batch from 0
    roundings = _batch_rounding(hf, [prompts[i] for i in at_start], [references[i] for i in at_start])
    for i, rounding in zip(at_start, roundings):
        references[i] = replace(references[i], batch_rounding=rounding)
    return references


def _batch_rounding(hf: HFForward, prompts: list[ProbePrompt], references: list[Reference]) -> list[float]:
    """Per prompt: HF's own prefill logits in one right-padded batch of every prompt against alone.

    The padding comes after each prompt's tokens, where a causal model's real positions never look,
    so HF's values are the same up to rounding (other matrix shapes, other kernels). A model whose
    batched forward fails gives no estimate (0): the fixed bound applies.
    """
    longest = max(len(p.token_ids) for p in prompts)
    rows = [p.token_ids + [p.token_ids[0]] * (longest - len(p.token_ids)) for p in prompts]
    kwargs: dict = {"input_ids": torch.tensor(rows, device=hf.device)}  # [P, T]
    if "attention_mask" in hf.takes:
        mask = [[1] * len(p.token_ids) + [0] * (longest - len(p.token_ids)) for p in prompts]
        kwargs["attention_mask"] = torch.tensor(mask, device=hf.device)  # [P, T]
    if "use_cache" in hf.takes:
        kwargs["use_cache"] = False
    try:
        with torch.no_grad():
            logits = hf.model(**kwargs).logits  # [P, T, V]
    except Exception:
        return [0.0] * len(prompts)
    return [
        relative_error(logits[row, : len(prompt.token_ids)], reference.prefill)
        for row, (prompt, reference) in enumerate(zip(prompts, references))
    ]


def _references(hf: HFForward, prompts: list[ProbePrompt]) -> list[Reference]:
    references = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt.token_ids], device=hf.device)  # [1, T]
            start = prompt.first_position
            prefill = hf.call(ids, None, first_position=start)
            cache = hf.cache_in(prefill)
            next_ids = torch.tensor([[prompt.next_token_id]], device=hf.device)  # [1, 1]
            if cache is None:  # no cache: HF runs the whole sequence again
                decode = hf.call(torch.cat([ids, next_ids], dim=1), None, first_position=start)
            else:
                decode = hf.call(next_ids, cache, num_cached=ids.shape[1], first_position=start)
            references.append(Reference(prefill.logits[0], decode.logits[0, -1]))
    return references


def _refusal(family: str, prompts: list[ProbePrompt], error: BaseException) -> ModelRefusedError:
    return ModelRefusedError(
        f"{family}: the model's own HF forward fails on a plain {len(prompts[0].token_ids)}-token prompt, so "
        f"nnrun cannot run it ({type(error).__name__}: {error})"
    )


def packed_path_difference(
    runner: "ModelRunner", packed: "PackedPath", prompts: list[ProbePrompt], references: list[Reference]
) -> str | None:
    """What differs between the `packed` path and HF on the probe prompts, or None if nothing does.

    The model is checked on a copy of the path with the torch attention backend, whose math is HF's own
    (in half precision too), at the tight bound: what the packed layout gets wrong (positions, masks,
    sinks, states crossing requests) shows there. The path itself, on the configured kernels (FlashInfer),
    is then checked at the bound two half-precision kernels' rounding allows, which a wrong page or mask
    still exceeds.
    """
    on_torch = replace(packed, backend=runner.torch_attention_backend())
    reason = _steps_difference(runner, on_torch, prompts, references, relative_tolerance(runner.dtype, references))
    if reason is None and runner.attn_backend is not runner.torch_attention_backend():
        reason = _steps_difference(runner, packed, prompts, references, kernel_tolerance(runner.dtype, references))
        if reason is not None:
            reason += f" on the {runner.attn_backend.name} attention kernels"
    return reason


def _steps_difference(
    runner: "ModelRunner", path: "PackedPath", prompts: list[ProbePrompt], references: list[Reference], rtol: float
) -> str | None:
    """The prompts from position 0 packed in one step, then each high-position prompt in a step of its own."""
    steps = [[i for i, p in enumerate(prompts) if not p.first_position]]
    steps += [[i] for i, p in enumerate(prompts) if p.first_position]
    for step in steps:
        reason = (
            _difference(runner, path, [prompts[i] for i in step], [references[i] for i in step], rtol) if step else None
        )
        if reason is not None:
            return reason
    return None


def _difference(
    runner: "ModelRunner", path: "PackedPath", prompts: list[ProbePrompt], references: list[Reference], rtol: float
) -> str | None:
    try:
        prefills, decodes = _run_packed(runner, path, prompts)
    except Exception as error:  # a packed step that fails is a packed path that cannot serve this model
        return f"the packed forward fails ({type(error).__name__}: {error})"
    for prompt, reference, prefill, decode in zip(prompts, references, prefills, decodes):
        error = differs(prefill, reference.prefill[-prefill.shape[0] :], rtol)
        if error is not None:
            alone = _run_packed(runner, path, [prompt], with_decode=False, last_only=prefill.shape[0] == 1)[0][0]
            where = (
                "even alone"
                if differs(alone, reference.prefill[-alone.shape[0] :], rtol) is not None
                else "only when packed with other prompts"
            )
            return (
                f"the prefill logits of a {prompt.describe()} differ from HF's by {error:.2g} "
                f"of their magnitude, {where}"
            )
        error = differs(decode, reference.decode, rtol)
        if error is not None:
            return (
                f"the decode-step logits after a {prompt.describe()} differ from HF's "
                f"(with HF's own cache) by {error:.2g} of their magnitude"
            )
    return None


def _run_packed(
    runner: "ModelRunner",
    path: "PackedPath",
    prompts: list[ProbePrompt],
    with_decode: bool = True,
    last_only: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per prompt: packed prefill logits and (with_decode) the packed decode step's `[V]`.

    The second of several prompts keeps only its last position's logits (`[1, V]`), as a generation
    does, the others every position's (`[T, V]`): a model that ignores `logits_to_keep` shows.
    """
    prefills: list[torch.Tensor] = []
    decodes: list[torch.Tensor] = []
    with runner.step_lock, runner._transient_requests([p.token_ids for p in prompts]) as reqs:
        forward_batch = packed_forward_batch(
            reqs,
            ForwardMode.EXTEND,
            runner.req_to_token_pool.req_to_token,
            runner.allocator.page_size,
            [not last_only and (len(reqs) == 1 or row != 1) for row in range(len(reqs))],
        )
        output = runner.packed_step(_at_first_positions(forward_batch, prompts), path)
        for row, prompt_logits in enumerate(output.prompt_logits or [None] * len(reqs)):
            last = output.next_token_logits[row : row + 1]  # [1, V]
            prefills.append(last if prompt_logits is None else torch.cat([prompt_logits, last]))
        if not with_decode:
            return prefills, decodes
        for req, prompt in zip(reqs, prompts):
            req.num_computed_tokens = req.num_tokens
            req.output_token_ids.append(prompt.next_token_id)
            if not hold_kv(req, req.num_tokens, runner.allocator, runner.req_to_token_pool):
                raise RuntimeError("the KV pool cannot hold the exactness probe's prompts")
        decode_batch = _at_first_positions(path.decode_batch(runner, reqs), prompts)
        decodes = list(runner.packed_step(decode_batch, path).next_token_logits)
    return prefills, decodes


def _at_first_positions(forward_batch: ForwardBatch, prompts: list[ProbePrompt]) -> ForwardBatch:
    """The batch with each request's positions (its `position_ids`) moved on by its prompt's first position.

    Only the positions move: the KV layout, masks and windows stay each request's own tokens.
    """
    offsets = torch.tensor([p.first_position for p in prompts], dtype=torch.int64)  # [B]
    if not offsets.any():
        return forward_batch
    per_token = torch.repeat_interleave(offsets, torch.tensor(forward_batch.extend_seq_lens))  # [N]
    return replace(forward_batch, positions=forward_batch.positions + per_token)
