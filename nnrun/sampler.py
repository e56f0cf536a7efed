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
    known_errors: dict[int, str] = field(default_factory=dict)  # row -> why it could not be sampled (its request fails)
    # [R] bool on the device: rows not sampled, their tokens placeholders; read back (a sync) only when
    # `row_errors` is asked, so a multi-step window's steps sample without waiting for the GPU
    unsamplable: torch.Tensor | None = None

    @property
    def row_errors(self) -> dict[int, str]:
        """Row -> why it could not be sampled: its request fails (read from the device the first time)."""
        if self.unsamplable is not None:
            rows = self.unsamplable.nonzero().flatten().tolist()
            self.known_errors.update(dict.fromkeys(rows, UNSAMPLABLE_ROW))
            self.unsamplable = None
        return self.known_errors

    @row_errors.setter
    def row_errors(self, errors: dict[int, str]) -> None:
        self.known_errors, self.unsamplable = errors, None


UNSAMPLABLE_ROW = (
    "its logits hold NaN or +inf, or no finite value, after temperature and filtering, so no token "
    "can be sampled (HF's sampling raises on such a row)"
)


@dataclass
class RowSettings:
    """The rows' temperature and filters as columns: read off each row, or broadcast from shared params."""

    temperature: torch.Tensor  # [S, 1] float32
    filtered: list[int] | None  # rows that ask for top-k or top-p; None: every row does
    top_k: torch.Tensor | None  # [F] int64 (the vocabulary size where a row has no top-k); None: no row filters
    max_top_k: int  # the largest of top_k (read on the host: the partial sort's width)
    top_p: torch.Tensor | None  # [F, 1] float32; None when no filtered row asks for top-p
    min_p: torch.Tensor | None  # [S, 1] float32; None when no row asks for min-p
    generators: list[torch.Generator | None] | None  # per row; None when no row has its own

    @classmethod
    def of_rows(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "RowSettings":
        params = [row.params for row in rows]
        filtered = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        picked = [params[j] for j in filtered]
        top_k = top_p = None
        top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in picked]
        if filtered:
            top_k = torch.tensor(top_ks, device=device)  # [F] int64
            top_p = _column([p.top_p for p in picked], device) if any(p.top_p < 1.0 for p in picked) else None
        min_p = [p.min_p for p in params]
        generators = [row.generator for row in rows]
        return cls(
            temperature=_column([p.temperature for p in params], device),
            filtered=None if len(filtered) == len(rows) else filtered,
            top_k=top_k,
            max_top_k=max(top_ks, default=0),
            top_p=top_p,
            min_p=_column(min_p, device) if any(p > 0 for p in min_p) else None,
            generators=generators if any(g is not None for g in generators) else None,
        )

    @classmethod
    def shared(cls, params: SamplingParams, num_rows: int, vocab_size: int, device: torch.device) -> "RowSettings":
        """Every row under `params`, none with its own generator: columns of one value (the same float32s)."""
        is_filtered = params.top_k > 0 or params.top_p < 1.0
        top_k = min(params.top_k, vocab_size) if params.top_k > 0 else vocab_size
        return cls(
            temperature=_full(num_rows, params.temperature, device),
            filtered=None if is_filtered else [],
            top_k=torch.full((num_rows,), top_k, dtype=torch.int64, device=device) if is_filtered else None,
            max_top_k=top_k if is_filtered else 0,
            top_p=_full(num_rows, params.top_p, device) if is_filtered and params.top_p < 1.0 else None,
            min_p=_full(num_rows, params.min_p, device) if params.min_p > 0 else None,
            generators=None,
        )


MAX_DIM_FROM = 4096  # values, where `max(dim)` overtakes `argmax` on CPU (measured: even at 8 x 256)


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] int64: each row's index of its largest value, `torch.argmax`'s answer (HF's greedy pick).

    On CPU, from `MAX_DIM_FROM` values on, through `max(dim=-1)`, which gives the same index (the first of tied
    values, the first NaN of a row that has one; checked against argmax in tests) 1.6x faster there: 14 -> 8 ms a
    step at 256 rows of 32k logits (below a few thousand values its two outputs cost more: 4.8 vs 2.3 µs for one row
    of 256). Elsewhere `argmax` itself: a CUDA `max(dim)` does not promise the first of tied values.
    """
    if values.is_cpu and values.numel() >= MAX_DIM_FROM:
        return values.max(dim=-1).indices
    return values.argmax(dim=-1)


class Sampler:
    """Chooses one token per row: greedy rows never touch an RNG, seeded rows draw only from their own."""

    def sample_shared(self, logits: torch.Tensor, params: SamplingParams) -> SamplerOutput:
        """Every row under the same `params`, without penalties or own generators: whole-batch ops only.

        The same tokens and logprobs as `__call__` on those rows, with no Python per row: greedy is
        one `row_argmax`, sampling one batched temperature/filter/draw (the default RNG, consumed as there).
        """
        assert logits.dim() == 2 and not params.has_penalties and params.seed is None
        raw = logits.float()  # [R, V]; aliases the caller's tensor when it is float32, so only out-of-place ops
        unsamplable = None
        if params.is_greedy:
            token_ids = row_argmax(raw)  # [R] int64
        else:
            settings = RowSettings.shared(params, raw.shape[0], raw.shape[1], raw.device)
            token_ids, unsamplable = _sample(raw, settings)  # [R] int64, [R] bool
            token_ids.masked_fill_(unsamplable, 0)  # placeholders: a failed request never appends its token
        if params.logprobs is None:
            return SamplerOutput(token_ids, None, None, None, unsamplable=unsamplable)
        logprobs, top_ids, top_logprobs = compute_logprobs(raw, token_ids, params.logprobs)
        return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs, unsamplable=unsamplable)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one row of logits per SamplingRow"
        raw = logits.float()  # [R, V]; aliases the caller's tensor when it is float32, so only out-of-place ops
        penalized = apply_penalties(raw, rows)  # [R, V]; same aliasing rule
        sample_indices = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        row_errors: dict[int, str] = {}
        vocab_size, device = logits.shape[1], logits.device
        if len(sample_indices) == len(rows):
            settings = RowSettings.of_rows(rows, vocab_size, device)
            token_ids, is_unsamplable = _sample(penalized, settings)  # [R] int64, [R] bool
        else:
            token_ids = row_argmax(penalized)  # [R] int64; final for greedy rows
            is_unsamplable = None
            if sample_indices:
                index = torch.tensor(sample_indices, device=device)  # [S] int64
                settings = RowSettings.of_rows([rows[i] for i in sample_indices], vocab_size, device)
                token_ids[index], is_unsamplable = _sample(penalized[index], settings)
        if is_unsamplable is not None and bool(is_unsamplable.any()):
            bad_rows = [sample_indices[j] for j in is_unsamplable.nonzero().flatten().tolist()]
            token_ids[bad_rows] = 0  # placeholders: a failed request never appends its token
            row_errors = dict.fromkeys(bad_rows, UNSAMPLABLE_ROW)
        output = _with_logprobs(raw, token_ids, rows)
        output.known_errors = row_errors
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


def _sample(logits: torch.Tensor, settings: RowSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p, min-p, then an exact categorical draw per row -> [S] int64.

    Also returns which rows cannot be sampled ([S] bool): a NaN anywhere, or no probability
    mass left. Such a row (a block wrote NaN, say) fails its own request, not the batch.
    """
    # A new tensor: the filters below may write in place without touching the caller's logits.
    logits = logits / settings.temperature  # [S, V]
    logits = _apply_top_k_top_p(logits, settings)
    if settings.min_p is not None:
        max_logit = logits.amax(dim=-1, keepdim=True)  # [S, 1]
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); log(0) = -inf drops nothing.
        logits.masked_fill_(logits < max_logit + settings.min_p.log(), float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [S, V]
    is_unsamplable = probs.isnan().any(dim=-1)  # [S] bool; an all -inf row softmaxes to NaN too
    # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) is distributed exactly as Categorical(p).
    return row_argmax(probs.div_(_exponential_noise(probs, settings.generators))), is_unsamplable


def _apply_top_k_top_p(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """Mask tokens outside top-k, then outside the top-p nucleus; only rows that ask for either are sorted."""
    if settings.top_k is None:
        return logits
    if settings.filtered is None:
        return _top_k_top_p(logits, settings.top_k, settings.max_top_k, settings.top_p)
    index = torch.tensor(settings.filtered, device=logits.device)  # [F] int64
    logits[index] = _top_k_top_p(logits[index], settings.top_k, settings.max_top_k, settings.top_p)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int, top_p: torch.Tensor | None) -> torch.Tensor:
    """Filter [F, V] logits in place; ties with the k-th logit survive, as in HF's TopKLogitsWarper."""
    if top_p is None:
        # top-k alone: a partial topk is cheaper than a full sort.
        top_values = logits.topk(max_top_k, dim=-1).values  # [F, max_k]
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


def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None] | None) -> torch.Tensor:
    """Exp(1) noise [S, V]: seeded rows draw V values from their own generator, whatever else is in the batch."""
    noise = torch.empty_like(probs)  # [S, V]
    if generators is None:
        noise.exponential_()
    else:
        unseeded = [j for j, generator in enumerate(generators) if generator is None]
        if unseeded:
            index = torch.tensor(unseeded, device=probs.device)  # [U] int64
            noise[index] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        for j, generator in enumerate(generators):
            if generator is not None:
                noise[j].exponential_(generator=generator)
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


def _full(num_rows: int, value: float, device: torch.device) -> torch.Tensor:
    return torch.full((num_rows, 1), value, dtype=torch.float32, device=device)  # [N, 1], as `_column` of N values
