"""Sampler tests: hand-computed oracles for penalties and filters, empirical checks of the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from nnrun.sampler import Sampler, SamplingRow, apply_penalties, compute_logprobs, row_argmax
from nnrun.sampling_params import SamplingParams

NEG_INF = float("-inf")
# Distinct, well-separated logits: no filter threshold below falls near a token's probability.
LOGITS = [2.0, 1.2, 0.9, 0.1, -0.3, -1.0, -1.8, -2.5]
NUM_DRAWS = 20_000


def _row(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator)


def _draw(logits: list[float], params: SamplingParams, num_draws: int = NUM_DRAWS) -> torch.Tensor:
    """One batched call with `num_draws` identical rows -> empirical frequency of each token [V]."""
    batch = torch.tensor(logits).repeat(num_draws, 1)  # [num_draws, V]
    token_ids = Sampler()(batch, [_row(params) for _ in range(num_draws)]).token_ids  # [num_draws]
    return torch.bincount(token_ids, minlength=len(logits)).double() / num_draws  # [V]


def _softmax(logits: list[float], temperature: float = 1.0) -> list[float]:
    exps = [math.exp(x / temperature) if x != NEG_INF else 0.0 for x in logits]
    return [e / sum(exps) for e in exps]


def _renormalized(probs: list[float], support: set[int]) -> list[float]:
    kept = [p if i in support else 0.0 for i, p in enumerate(probs)]
    return [p / sum(kept) for p in kept]


def _assert_frequencies(freqs: torch.Tensor, expected: list[float], num_draws: int = NUM_DRAWS) -> None:
    """Each token's frequency within 5 standard errors of its expected probability; zero-prob tokens never drawn.

    A binomial frequency has standard error sqrt(p(1-p)/n) <= 0.0036 at n = 20k; 5 sigma over 8 tokens
    gives a false-failure rate below 1e-5, while a wrong distribution in these tests is off by >= 0.03.
    """
    for token, (freq, p) in enumerate(zip(freqs.tolist(), expected)):
        if p == 0.0:
            assert freq == 0.0, f"token {token} has probability 0 but was drawn ({freq:.4f})"
        else:
            tolerance = 5 * math.sqrt(p * (1 - p) / num_draws) + 1e-4
            assert abs(freq - p) <= tolerance, (
                f"token {token}: frequency {freq:.4f}, expected {p:.4f} +- {tolerance:.4f}"
            )


def _assert_distinguishable(expected: list[float], wrong: list[float]) -> None:
    """The oracle must be able to fail: the tested distribution differs from a plausible wrong one by > 5 sigma."""
    assert max(abs(a - b) for a, b in zip(expected, wrong)) > 5 * 0.5 / math.sqrt(NUM_DRAWS)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_greedy_equals_argmax_and_consumes_no_rng():
    logits = torch.randn(16, 100)  # [R, V]
    generator = torch.Generator().manual_seed(1)
    rows = [_row(SamplingParams(temperature=0.0), generator=generator if i == 3 else None) for i in range(16)]
    rng_state, generator_state = torch.get_rng_state(), generator.get_state()
    out = Sampler()(logits, rows)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert torch.equal(generator.get_state(), generator_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_argmax_is_torch_argmax_on_ties_nan_and_infinities(dtype):
    """The greedy pick is HF's (`torch.argmax`) where it matters most: the first of tied values, the first NaN of a row
    that has one, +inf, rows all -inf; on shapes from one row and one token up to a vocabulary's width."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(24):
        rows, width = [(1, 1), (1, 7), (5, 256), (33, 1000), (300, 4099), (2, 32000)][trial % 6]
        logits = torch.randn(rows, width, generator=generator)
        kind = trial // 6
        if kind == 1:
            logits = logits.round()  # many ties, some at the maximum
        elif kind == 2:
            logits[torch.rand(rows, width, generator=generator) < 0.02] = float("nan")
            logits[0, -1] = float("nan")
        elif kind == 3:
            logits[torch.rand(rows, width, generator=generator) < 0.5] = NEG_INF
            logits[0] = NEG_INF
            logits[-1, width // 2 :] = float("inf")
        logits = logits.to(dtype)
        assert torch.equal(row_argmax(logits), logits.argmax(dim=-1)), (trial, rows, width)


def test_greedy_with_penalties_equals_argmax_of_hand_penalized_logits():
    logits = torch.tensor([[3.0, 2.9, -0.5, 1.0], [2.0, 1.9, 1.8, -4.0]])  # [2, 4]
    rows = [
        _row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[0]),  # 3.0 / 1.5 = 2.0 < 2.9
        _row(SamplingParams(temperature=0.0, presence_penalty=0.2, frequency_penalty=0.1), output=[0, 1, 1]),
    ]
    # Row 1: token 0 -> 2.0 - 0.1 - 0.2 = 1.7, token 1 -> 1.9 - 0.2 - 0.2 = 1.5, token 2 stays 1.8.
    assert Sampler()(logits, rows).token_ids.tolist() == [1, 2]
    assert logits.argmax(dim=-1).tolist() == [0, 0]  # the penalties are what changed the answer


def test_apply_penalties_matches_hand_computed_logits():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, NEG_INF],
        ]
    )  # [3, 6]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [
        _row(params, prompt=[0, 1], output=[3, 3, 4]),
        _row(SamplingParams(), prompt=[0, 1], output=[3, 3, 4]),  # no penalties: untouched
        _row(SamplingParams(frequency_penalty=1.0), prompt=[0, 3], output=[1, 5, 5]),  # prompt not counted
    ]
    before = logits.clone()
    expected = torch.tensor(
        [
            # 0: prompt, positive -> 2/2; 1: prompt, negative -> -1*2; 3: output x2 -> 3/2 - 0.5*2 - 0.25;
            # 4: output x1, negative -> -2*2 - 0.5 - 0.25
            [1.0, -2.0, 0.5, 0.25, -4.75, 0.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
            # 1: output x1 -> -1 - 1; 5: -inf stays -inf
            [2.0, -2.0, 0.5, 3.0, -2.0, NEG_INF],
        ]
    )
    penalized = apply_penalties(logits, rows)
    assert penalized.dtype == torch.float32
    assert torch.equal(penalized, expected)
    assert torch.equal(logits, before)


def test_top_k_support_and_frequencies():
    freqs = _draw(LOGITS, SamplingParams(top_k=3))
    expected = _renormalized(_softmax(LOGITS), {0, 1, 2})
    _assert_distinguishable(expected, _softmax(LOGITS))
    _assert_frequencies(freqs, expected)


def test_top_k_keeps_ties_with_kth_logit_like_hf():
    freqs = _draw([1.0, 3.0, 1.0, 0.0, 1.0], SamplingParams(top_k=2), num_draws=4000)
    assert set(torch.nonzero(freqs).flatten().tolist()) == {0, 1, 2, 4}


def _nucleus(probs: list[float], top_p: float) -> set[int]:
    """HF TopPLogitsWarper: the smallest set of most likely tokens whose mass reaches top_p."""
    support, mass = set(), 0.0
    for token in sorted(range(len(probs)), key=lambda t: -probs[t]):
        support.add(token)
        mass += probs[token]
        if mass >= top_p:
            return support
    return support


def test_top_p_support_and_frequencies():
    probs = _softmax(LOGITS)
    support = _nucleus(probs, 0.8)
    assert support == {0, 1, 2}  # cumulative mass .47, .69, .84 crosses 0.8 at the third token
    expected = _renormalized(probs, support)
    _assert_distinguishable(expected, probs)
    _assert_frequencies(_draw(LOGITS, SamplingParams(top_p=0.8)), expected)


def test_top_p_applies_after_temperature():
    probs = _softmax(LOGITS, 2.0)
    support = _nucleus(probs, 0.8)
    assert support == {0, 1, 2, 3, 4}  # cumulative mass .29, .49, .66, .77, .86; at T=1 it would be {0, 1, 2}
    expected = _renormalized(probs, support)
    _assert_distinguishable(expected, _renormalized(probs, _nucleus(_softmax(LOGITS), 0.8)))
    _assert_frequencies(_draw(LOGITS, SamplingParams(temperature=2.0, top_p=0.8)), expected)


def test_top_p_always_keeps_the_top_token():
    freqs = _draw(LOGITS, SamplingParams(top_p=0.01), num_draws=2000)
    assert freqs.tolist()[0] == 1.0


def test_min_p_support_and_frequencies_after_temperature():
    temperature, min_p = 1.5, 0.25
    probs = _softmax(LOGITS, temperature)
    support = {i for i, p in enumerate(probs) if p >= min_p * max(probs)}
    assert support == {0, 1, 2, 3}  # ratios to the max prob: 1, .59, .48, .28, .22, ...
    expected = _renormalized(probs, support)
    _assert_distinguishable(expected, probs)
    _assert_frequencies(_draw(LOGITS, SamplingParams(temperature=temperature, min_p=min_p)), expected)


def _hf_order_support(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """HF's warper order: top-k, then top-p on the renormalized survivors, then min-p."""
    after_top_k = _renormalized(probs, set(sorted(range(len(probs)), key=lambda t: -probs[t])[:top_k]))
    after_top_p = _renormalized(after_top_k, _nucleus(after_top_k, top_p))
    return {i for i, p in enumerate(after_top_p) if p > 0 and p >= min_p * max(after_top_p)}


@pytest.mark.parametrize(
    "top_k, top_p, min_p, support, other_order_support",
    [
        # top-p sees top-k's renormalized mass (.56, .81): {0, 1}; top-p alone would keep {0, 1, 2}.
        (3, 0.8, 0.0, {0, 1}, {0, 1, 2}),
        # min-p after top-p keeps {0, 1, 2}; min-p first would renormalize to (.56, .81) and top-p keep {0, 1}.
        (8, 0.8, 0.2, {0, 1, 2}, {0, 1}),
    ],
)
def test_filters_compose_in_hf_order(top_k, top_p, min_p, support, other_order_support):
    probs = _softmax(LOGITS)
    assert _hf_order_support(probs, top_k, top_p, min_p) == support
    expected = _renormalized(probs, support)
    _assert_distinguishable(expected, _renormalized(probs, other_order_support))
    _assert_frequencies(_draw(LOGITS, SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)), expected)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature: float):
    expected = _softmax(LOGITS, temperature)
    _assert_distinguishable(expected, _softmax(LOGITS))
    _assert_frequencies(_draw(LOGITS, SamplingParams(temperature=temperature)), expected)


def test_masked_tokens_are_never_sampled():
    logits = [NEG_INF, 0.5, NEG_INF, 0.0, NEG_INF, NEG_INF]
    for params in [SamplingParams(), SamplingParams(top_k=4, top_p=0.95), SamplingParams(min_p=0.05)]:
        freqs = _draw(logits, params)
        _assert_frequencies(freqs, _softmax(logits))


def _seeded_tokens(seed: int, position: int, others: list[SamplingParams], steps: int = 20) -> list[int]:
    """Tokens a row seeded with `seed` draws over `steps` calls, placed at `position` among `others`."""
    logits = torch.linspace(-1.0, 1.0, 50)  # [V] near-flat: distinct seeds almost surely diverge
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(steps):
        rows = [_row(params) for params in others]
        rows.insert(position, _row(SamplingParams(seed=seed, top_k=40), generator=generator))
        batch = logits.repeat(len(rows), 1)  # [R, V]
        tokens.append(Sampler()(batch, rows).token_ids[position].item())
    return tokens


def test_seeded_rows_are_deterministic_regardless_of_batch():
    alone = _seeded_tokens(42, 0, [])
    assert _seeded_tokens(42, 0, []) == alone
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5), SamplingParams(seed=7)]
    assert _seeded_tokens(42, 2, others) == alone
    assert _seeded_tokens(42, 4, others) == alone
    assert _seeded_tokens(43, 0, []) != alone


def test_seeded_rows_sample_the_right_distribution():
    num_draws = 4000
    batch = torch.tensor(LOGITS).repeat(num_draws, 1)  # [num_draws, V]
    params = SamplingParams(seed=0, top_k=4)
    rows = [_row(params, generator=torch.Generator().manual_seed(i)) for i in range(num_draws)]
    token_ids = Sampler()(batch, rows).token_ids  # [num_draws]
    freqs = torch.bincount(token_ids, minlength=len(LOGITS)).double() / num_draws  # [V]
    _assert_frequencies(freqs, _renormalized(_softmax(LOGITS), {0, 1, 2, 3}), num_draws)


def test_logprobs_are_raw_log_softmax_and_input_is_unchanged():
    logits = torch.randn(4, 30)  # [R, V]
    logits[1, :10] = NEG_INF
    before = logits.clone()
    rows = [
        _row(SamplingParams(logprobs=None, repetition_penalty=1.3), prompt=[1, 2]),
        _row(SamplingParams(logprobs=0, temperature=0.5, top_p=0.7, frequency_penalty=1.0), output=[12, 12]),
        _row(SamplingParams(logprobs=3, temperature=0.0, presence_penalty=0.5), output=[4]),
        _row(SamplingParams(logprobs=5, top_k=3, min_p=0.2)),
    ]
    out = Sampler()(logits, rows)
    assert torch.equal(logits, before)
    raw = torch.log_softmax(logits, dim=-1)  # [R, V]
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    top = raw.topk(5, dim=-1)
    assert out.top_logprob_ids.shape == (4, 5) and out.top_logprob_ids.dtype == torch.int64
    assert torch.equal(out.top_logprob_ids, top.indices)
    assert torch.allclose(out.top_logprobs, top.values)
    assert out.top_logprobs.dtype == torch.float32


def test_logprobs_absent_unless_asked():
    logits = torch.randn(2, 10)  # [R, V]
    out = Sampler()(logits, [_row(SamplingParams()), _row(SamplingParams(temperature=0.0))])
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None
    out = Sampler()(logits, [_row(SamplingParams(logprobs=0)), _row(SamplingParams())])
    assert out.logprobs.shape == (2,) and out.top_logprob_ids is None and out.top_logprobs is None


def test_half_precision_logits_are_accepted_and_unchanged():
    logits = torch.randn(3, 20).to(torch.bfloat16)  # [R, V]
    before = logits.clone()
    params = SamplingParams(top_k=5, repetition_penalty=1.2, logprobs=2)
    out = Sampler()(logits, [_row(params, prompt=[1]) for _ in range(3)])
    assert torch.equal(logits, before)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.top_logprobs, torch.log_softmax(logits.float(), dim=-1).topk(2).values)


def test_compute_logprobs_for_prompt_targets():
    logits = torch.randn(5, 12)  # [num_prompt_tokens, V]
    targets = torch.tensor([3, 0, 11, 7, 7])  # [num_prompt_tokens]
    target_logprobs, top_ids, top_logprobs = compute_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, dim=-1)  # [num_prompt_tokens, V]
    assert torch.allclose(target_logprobs, raw[torch.arange(5), targets])
    assert torch.equal(top_ids, raw.topk(2).indices)
    assert torch.allclose(top_logprobs, raw.topk(2).values)
    assert compute_logprobs(logits, targets, 0)[1:] == (None, None)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4, logprobs=0),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, logprobs=2),
        SamplingParams(min_p=0.2),
    ],
)
def test_shared_params_fast_path_equals_the_per_row_sampler_bitwise(params):
    """Rows sharing one SamplingParams take whole-batch ops: the same tokens, logprobs and RNG draws as per row."""
    logits = torch.randn(9, 40, generator=torch.Generator().manual_seed(3)) * 3  # [R, V]
    logits[4] = float("nan")  # an unsamplable row fails alone (greedy rows take its argmax, as per row)
    logits[6, :20] = logits[6, 0]  # ties
    torch.manual_seed(1)
    per_row = Sampler()(logits, [_row(params) for _ in range(9)])
    after_per_row = torch.rand(1)  # the default RNG is consumed exactly as much on both paths
    torch.manual_seed(1)
    shared = Sampler().sample_shared(logits, params)
    assert torch.equal(torch.rand(1), after_per_row)
    assert torch.equal(shared.token_ids, per_row.token_ids)
    assert shared.row_errors == per_row.row_errors
    for name in ("logprobs", "top_logprob_ids", "top_logprobs"):
        ours, theirs = getattr(shared, name), getattr(per_row, name)
        if ours is None or theirs is None:
            assert ours is theirs, name
            continue
        assert ours.dtype == theirs.dtype and ((ours == theirs) | (ours.isnan() & theirs.isnan())).all(), name
