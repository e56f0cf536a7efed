"""The torch backend's decode with heads packed as keys equals attention computed request by request."""

from __future__ import annotations

import math

import pytest
import torch

from nnrun.attention.masks import allowed_keys
from nnrun.attention.score_terms import ScoreTerms
from nnrun.attention.torch_backend import (
    _attend_heads_as_keys,
    _has_plain_scores,
    _heads_as_keys_mask,
    _heads_fit_as_keys,
)

SEQ_LENS = [1, 5, 17, 24, 9]  # padded to 24: rows past a request's end hold garbage the mask must drop


def _decode_case(num_q_heads: int, num_kv_heads: int, dtype: torch.dtype = torch.float32, head_dim: int = 16):
    generator = torch.Generator().manual_seed(num_q_heads * 10 + num_kv_heads)
    num, kv_len = len(SEQ_LENS), max(SEQ_LENS)
    q = torch.randn(num, num_q_heads, head_dim, generator=generator).to(dtype)  # [B, Hq, D]
    keys = torch.randn(num, kv_len, num_kv_heads, head_dim, generator=generator).to(dtype)  # [B, L, Hkv, D]
    values = torch.randn(num, kv_len, num_kv_heads, head_dim, generator=generator).to(dtype)  # [B, L, Hkv, D]
    return q, keys, values


def _allowed(window: int | None, chunk: int | None) -> torch.Tensor:
    """[B, 1, 1, L] bool as the backend plans it: each request's one new token at position seq_len - 1."""
    seq_lens = torch.tensor(SEQ_LENS)
    kv_pos = torch.arange(max(SEQ_LENS))[None, :]
    return allowed_keys((seq_lens - 1)[:, None], kv_pos, window, chunk)[:, None, None, :]


def _reference(q, keys, values, scaling, window, chunk, softcap) -> torch.Tensor:
    """Float64, one request and one head at a time, over that request's own keys only (no padding read)."""
    num, num_q_heads, _ = q.shape
    group = num_q_heads // keys.shape[2]
    out = torch.empty(num, num_q_heads, values.shape[-1], dtype=torch.float64)  # [B, Hq, Dv]
    for row, seq_len in enumerate(SEQ_LENS):
        positions = [p for p in range(seq_len) if _sees(seq_len - 1, p, window, chunk)]
        for head in range(num_q_heads):
            k = keys[row, positions, head // group].double()  # [n, D]
            scores = k @ q[row, head].double() * scaling  # [n]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[row, head] = scores.softmax(-1) @ values[row, positions, head // group].double()
    return out


def _sees(query: int, key: int, window: int | None, chunk: int | None) -> bool:
    in_window = window is None or key > query - window
    in_chunk = chunk is None or key // chunk == query // chunk
    return key <= query and in_window and in_chunk


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 2), (4, 4), (8, 1), (6, 3)])
@pytest.mark.parametrize(
    "window, chunk, softcap", [(None, None, None), (4, None, None), (None, 8, None), (None, None, 5.0)]
)
def test_heads_as_keys_matches_per_request_attention(num_q_heads, num_kv_heads, window, chunk, softcap):
    q, keys, values = _decode_case(num_q_heads, num_kv_heads)
    scaling = 1 / math.sqrt(q.shape[-1])
    mask = _heads_as_keys_mask(_allowed(window, chunk), num_q_heads, num_kv_heads)  # [B, Hq, L * Hkv]
    got = _attend_heads_as_keys(q, keys, values, mask, scaling, softcap)
    want = _reference(q, keys, values, scaling, window, chunk, softcap)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_heads_as_keys_mask_keeps_each_head_to_its_own_keys():
    allowed = _allowed(None, None)
    mask = _heads_as_keys_mask(allowed, 4, 2).view(len(SEQ_LENS), 4, max(SEQ_LENS), 2)  # [B, Hq, L, Hkv]
    seen = mask == 0
    for head in range(4):
        assert not seen[:, head, :, 1 - head // 2].any()  # never the other KV head's keys
        assert torch.equal(seen[:, head, :, head // 2], allowed[:, 0, 0])  # exactly its allowed positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_no_less_precise_than_sdpa(dtype):
    """The fast path accumulates in float32 and rounds once: its error is at most SDPA's in that dtype."""
    q, keys, values = _decode_case(4, 2, dtype)
    scaling = 0.25
    allowed = _allowed(None, None)
    got = _attend_heads_as_keys(q, keys, values, _heads_as_keys_mask(allowed, 4, 2), scaling, None)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=allowed, scale=scaling, enable_gqa=True
    )[:, :, 0]
    want = _reference(q, keys, values, scaling, None, None, None)
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() <= (sdpa.double() - want).abs().max()


def test_only_plain_scores_take_the_fast_path():
    assert _has_plain_scores(ScoreTerms(scaling=1.0, sliding_window=4, softcap=30.0, chunk_size=8))
    for extra in (
        {"sinks": torch.zeros(4)},
        {"alibi_slopes": torch.ones(4)},
        {"key_indices": torch.zeros(2, 3, dtype=torch.int64)},
        {"relative_logits": torch.zeros(2, 4, 3)},
    ):
        assert not _has_plain_scores(ScoreTerms(scaling=1.0, **extra))


def test_fast_path_is_for_small_heads_on_cpu():
    q, keys, _ = _decode_case(4, 2)
    assert _heads_fit_as_keys(q, keys)
    q_wide, keys_wide, _ = _decode_case(4, 2, head_dim=64)
    assert not _heads_fit_as_keys(q_wide, keys_wide)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_engine_decode_runs_the_fast_path_and_matches_hf(family, monkeypatch):
    """Decode steps of a batch (Gemma 2: softcap and a window) take the fast path and keep HF's tokens and logprobs."""
    import nnrun
    import nnrun.attention.torch_backend as torch_backend
    from model_zoo import hf_logits, make_model, make_twin, random_prompts

    calls = []
    fast = torch_backend._attend_heads_as_keys
    monkeypatch.setattr(torch_backend, "_attend_heads_as_keys", lambda *args: calls.append(1) or fast(*args))
    model = make_model(family)
    oracle = make_twin(model)
    prompts = random_prompts([3, 30, 12, 25], seed=5)
    with nnrun.LLM(model, page_size=4, attention_backend="torch") as llm:
        params = nnrun.SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
    assert calls
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        expected = torch.log_softmax(hf_logits(oracle, prompt + tokens), dim=-1)  # [T, V]
        for i, token in enumerate(tokens):
            position = len(prompt) - 1 + i
            assert token == expected[position].argmax().item()
            assert abs(output.outputs[0].logprobs[i][token] - expected[position, token].item()) < 1e-4


@pytest.mark.parametrize("window, chunk, softcap", [(None, None, None), (64, None, 5.0), (None, 64, None)])
def test_rows_that_see_all_their_keys_read_the_kept_mask_bitwise(window, chunk, softcap):
    """Equal-length rows under limits that do not bind: the mask kept across steps gives the built mask's bits."""
    from nnrun.attention.torch_backend import TorchAttnBackend
    from nnrun.forward_batch import ForwardBatch, ForwardMode, TableRows
    from nnrun.memory import KVPool, LayerKVShape

    num, kv_len, page_size = 3, 9, 4
    pool = KVPool([LayerKVShape(2, 16, 16)], 16, page_size, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(7)
    pool.k_pages[0].normal_(generator=generator)
    pool.v_pages[0].normal_(generator=generator)
    table = torch.randperm(16 * page_size, generator=generator)[: num * kv_len].view(num, kv_len)  # [B, L] slots
    positions = torch.full((num,), kv_len - 1)
    forward_batch = ForwardBatch(
        ForwardMode.DECODE, [None] * num, torch.zeros(num, dtype=torch.int64), positions, table[:, -1].clone(),
        [1] * num, list(range(num)), [kv_len - 1] * num, TableRows(table, [kv_len - 1] * num),
        torch.arange(num), list(range(num)), kv_slot_table=table,
    )  # fmt: skip
    q = torch.randn(num, 4, 16, generator=generator)  # [B, Hq, D]
    k, v = torch.randn(num, 2, 16, generator=generator), torch.randn(num, 2, 16, generator=generator)
    terms = ScoreTerms(0.25, sliding_window=window, softcap=softcap, chunk_size=chunk)
    backend = TorchAttnBackend(pool, torch.device("cpu"))
    backend.init_forward_metadata(forward_batch)
    assert backend.metadata.decode_rows_full
    kept = backend.forward(0, q, k, v, terms)
    assert next(iter(backend.metadata.heads_as_keys_masks.values())).shape[0] == 1  # one mask row for all requests
    backend.init_forward_metadata(forward_batch)
    backend.metadata.decode_rows_full = False  # as if some row were shorter: the step builds its own mask
    built = backend.forward(0, q, k, v, terms)
    assert next(iter(backend.metadata.heads_as_keys_masks.values())).shape[0] == num
    assert torch.equal(kept, built)
