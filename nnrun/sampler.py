"""Sampler: one step's logits -> one token per row (penalties, temperature, top-k/top-p/min-p) and raw logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nnrun.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits (one request)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far (before this step)
    generator: torch.Generator | None  # per-request RNG, set when params.seed is not None; None -> torch default RNG


@dataclass
class SamplerOutput:
    """The tokens chosen for one step, with their logprobs under the raw logits when any row asked."""

    token_ids: torch.Tensor  # [R] int64, on the logits' device
    logprobs: torch.Tensor | None  # [R] float32; None when no row asked for logprobs
    top_logprob_ids: torch.Tensor | None  # [R, K] int64, K = max requested logprobs; None when K == 0
    top_logprobs: torch.Tensor | None  # [R, K] float32, sorted descending
    row_errors: dict[int, str] = field(default_factory=dict)  # row -> why it could not be sampled (its request fails)


UNSAMPLABLE_ROW = (
    "its logits hold NaN or +inf, or no finite value, after temperature and filtering, so no token "
    "can be sampled (HF's sampling raises on such a row)"
)


class Sampler:
    """Chooses one token per row: greedy rows never touch an RNG, seeded rows draw only from their own."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one row of logits per SamplingRow"
        raw = logits.float()  # [R, V]; aliases the caller's tensor when it is float32, so only out-of-place ops
        penalized = apply_penalties(raw, rows)  # [R, V]; same aliasing rule
        sample_indices = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        row_errors: dict[int, str] = {}
        if len(sample_indices) == len(rows):
            token_ids, is_unsamplable = _sample(penalized, rows)  # [R] int64, [R] bool
        else:
            token_ids = penalized.argmax(dim=-1)  # [R] int64; final for greedy rows
            is_unsamplable = None
            if sample_indices:
                index = torch.tensor(sample_indices, device=logits.device)  # [S] int64
                token_ids[index], is_unsamplable = _sample(penalized[index], [rows[i] for i in sample_indices])
        if is_unsamplable is not None and bool(is_unsamplable.any()):
            bad_rows = [sample_indices[j] for j in is_unsamplable.nonzero().flatten().tolist()]
            token_ids[bad_rows] = 0  # placeholders: a failed request never appends its token
            row_errors = dict.fromkeys(bad_rows, UNSAMPLABLE_ROW)
        output = _with_logprobs(raw, token_ids, rows)
        output.row_errors = row_errors
        return output


def compute_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log_softmax(logits.float()) -> (target_ids' logprobs [R], top ids [R, num_top], top logprobs [R, num_top]).

    The top pair is None when num_top == 0; num_top is capped at the vocabulary size.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    target_logprobs = logprobs.gather(1, target_ids.long().unsqueeze(1)).squeeze(1)  # [R]
    num_top = min(num_top, logprobs.shape[1])
    if num_top <= 0:
        return target_logprobs, None, None
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [R, num_top] each, sorted descending
    return target_logprobs, top_ids, top_logprobs


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Float32 logits after repetition (prompt+output) and frequency/presence (output) penalties.

    Never writes to `logits`; returns `logits.float()` itself (possibly the caller's tensor) when no row
    has a penalty, so callers must not modify the result in place.
    """
    penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalized:
        return logits.float()
    device, vocab_size = logits.device, logits.shape[1]
    index = torch.tensor(penalized, device=device)  # [P] int64
    sub = logits[index].float()  # [P, V] a copy (advanced indexing)
    params = [rows[i].params for i in penalized]
    output_counts = _token_counts([rows[i].output_token_ids for i in penalized], vocab_size, device)  # [P, V]
    prompt_counts = _token_counts([rows[i].prompt_token_ids for i in penalized], vocab_size, device)  # [P, V]
    is_seen = (prompt_counts + output_counts) > 0  # [P, V] bool
    repetition = _column([p.repetition_penalty for p in params], device)  # [P, 1]
    # HF RepetitionPenaltyLogitsProcessor: dividing a negative logit would raise it, so negatives are multiplied.
    repeated = torch.where(sub > 0, sub / repetition, sub * repetition)  # [P, V]
    sub = torch.where(is_seen, repeated, sub)
    frequency = _column([p.frequency_penalty for p in params], device)  # [P, 1]
    presence = _column([p.presence_penalty for p in params], device)  # [P, 1]
    sub = sub - frequency * output_counts - presence * (output_counts > 0)
    out = logits.to(torch.float32, copy=True)  # [R, V]
    out[index] = sub
    return out


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p, min-p, then an exact categorical draw per row -> [S] int64.

    Also returns which rows cannot be sampled ([S] bool): a NaN anywhere, or no probability
    mass left. Such a row (a block wrote NaN, say) fails its own request, not the batch.
    """
    device = logits.device
    temperature = _column([row.params.temperature for row in rows], device)  # [S, 1]
    # A new tensor: the filters below may write in place without touching the caller's logits.
    logits = logits / temperature  # [S, V]
    logits = _apply_top_k_top_p(logits, rows)
    min_p = [row.params.min_p for row in rows]
    if any(p > 0 for p in min_p):
        max_logit = logits.amax(dim=-1, keepdim=True)  # [S, 1]
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); log(0) = -inf drops nothing.
        logits.masked_fill_(logits < max_logit + _column(min_p, device).log(), float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [S, V]
    is_unsamplable = probs.isnan().any(dim=-1)  # [S] bool; an all -inf row softmaxes to NaN too
    # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) is distributed exactly as Categorical(p).
    return probs.div_(_exponential_noise(probs, rows)).argmax(dim=-1), is_unsamplable


def _apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask tokens outside top-k, then outside the top-p nucleus; only rows that ask for either are sorted."""
    filtered = [j for j, row in enumerate(rows) if row.params.top_k > 0 or row.params.top_p < 1.0]
    if not filtered:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    params = [rows[j].params for j in filtered]
    top_k = torch.tensor(
        [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], device=device
    )  # [F] int64
    top_p = _column([p.top_p for p in params], device) if any(p.top_p < 1.0 for p in params) else None  # [F, 1]
    if len(filtered) == len(rows):
        return _top_k_top_p(logits, top_k, top_p)
    index = torch.tensor(filtered, device=device)  # [F] int64
    logits[index] = _top_k_top_p(logits[index], top_k, top_p)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """Filter [F, V] logits in place; ties with the k-th logit survive, as in HF's TopKLogitsWarper."""
    if top_p is None:
        # top-k alone: a partial topk is cheaper than a full sort.
        top_values = logits.topk(int(top_k.max()), dim=-1).values  # [F, max_k]
        kth_logit = top_values.gather(1, (top_k - 1).unsqueeze(1))  # [F, 1]
        return logits.masked_fill_(logits < kth_logit, float("-inf"))
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [F, V] each
    kth_logit = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))  # [F, 1]
    sorted_logits.masked_fill_(sorted_logits < kth_logit, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [F, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [F, V]; exactly 0 for the top token
    # Smallest prefix whose mass reaches top_p: a token survives iff the mass ranked above it is < top_p.
    # Rows with top_p == 1 are exempt, since rounding can push the cumulative sum past 1.
    is_dropped = (mass_before >= top_p) & (top_p < 1.0)  # [F, V] bool
    sorted_logits.masked_fill_(is_dropped, float("-inf"))
    return logits.scatter_(1, sorted_ids, sorted_logits)


def _exponential_noise(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Exp(1) noise [S, V]: seeded rows draw V values from their own generator, whatever else is in the batch."""
    noise = torch.empty_like(probs)  # [S, V]
    unseeded = [j for j, row in enumerate(rows) if row.generator is None]
    if len(unseeded) == len(rows):
        noise.exponential_()
    else:
        if unseeded:
            index = torch.tensor(unseeded, device=probs.device)  # [U] int64
            noise[index] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        for j, row in enumerate(rows):
            if row.generator is not None:
                noise[j].exponential_(generator=row.generator)
    # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    requested = [row.params.logprobs for row in rows if row.params.logprobs is not None]
    if not requested:
        return SamplerOutput(token_ids, None, None, None)
    logprobs, top_ids, top_logprobs = compute_logprobs(raw, token_ids, max(requested))
    return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each vocabulary id occurs in each list -> [len(token_lists), V] float32."""
    row_ids = torch.tensor([j for j, ids in enumerate(token_lists) for _ in ids], dtype=torch.long, device=device)
    token_ids = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.long, device=device)
    counts = torch.zeros(len(token_lists), vocab_size, device=device)  # [P, V] float32
    return counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=counts.dtype), accumulate=True)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [N, 1]
