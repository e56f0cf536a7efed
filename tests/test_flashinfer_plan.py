"""The FlashInfer planner: CSR page tables per step and plan groups per model (pure CPU)."""

from __future__ import annotations

import random

import pytest
import torch

import nnrun
from model_zoo import make_model, random_prompts
from nnrun.attention.flashinfer_plan import (
    PlanGroup,
    group_layers,
    layer_to_group_index,
    plan_forward_batch,
    plan_paged_kv,
    window_left_of,
)
from nnrun.forward_batch import ForwardMode
from nnrun.memory import LayerKVShape
from nnrun.model_probe import AttentionLayerInfo, probe_attention_layers


def _token_slots(plan, b: int) -> list[int]:
    """Every KV slot of request b, expanded from its CSR page list (page * page_size + offset)."""
    pages = plan.kv_indices[plan.kv_indptr[b] : plan.kv_indptr[b + 1]].tolist()
    seq_len = int(plan.seq_lens()[b])
    return [pages[pos // plan.page_size] * plan.page_size + pos % plan.page_size for pos in range(seq_len)]


def _check_invariants(plan, prefix_lens, extend_lens, page_tables) -> None:
    assert all(t.dtype == torch.int32 for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len))
    batch = len(prefix_lens)
    assert plan.qo_indptr.shape == plan.kv_indptr.shape == (batch + 1,) and plan.kv_last_page_len.shape == (batch,)
    assert plan.qo_indptr[0] == 0 and plan.kv_indptr[0] == 0
    assert (plan.qo_indptr.diff() >= 1).all() and (plan.kv_indptr.diff() >= 1).all()  # monotone, no empty request
    assert plan.qo_indptr.diff().tolist() == list(extend_lens)
    assert len(plan.kv_indices) == plan.kv_indptr[-1]
    assert ((plan.kv_last_page_len >= 1) & (plan.kv_last_page_len <= plan.page_size)).all()
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_pages = plan.kv_indptr.diff()
    assert ((num_pages - 1) * plan.page_size + plan.kv_last_page_len).tolist() == seq_lens  # get_seq_lens identity
    assert plan.seq_lens().tolist() == seq_lens
    for b, (table, seq_len) in enumerate(zip(page_tables, seq_lens)):
        expected = [table[pos // plan.page_size] * plan.page_size + pos % plan.page_size for pos in range(seq_len)]
        assert _token_slots(plan, b) == expected


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_random_batches_keep_every_invariant(page_size):
    rng = random.Random(page_size)
    for _ in range(50):
        batch = rng.randint(1, 6)
        prefix_lens = [rng.choice([0, rng.randint(0, 40)]) for _ in range(batch)]
        extend_lens = [rng.choice([1, rng.randint(1, 40)]) for _ in range(batch)]
        pool = rng.sample(range(400), k=400)  # shuffled: non-contiguous, often descending page ids
        page_tables = []
        for p, e in zip(prefix_lens, extend_lens):
            needed = -(-(p + e) // page_size) + rng.randint(0, 2)  # tables may hold spare pages
            page_tables.append([pool.pop() for _ in range(needed)])
        plan = plan_paged_kv(prefix_lens, extend_lens, page_tables, page_size)
        _check_invariants(plan, prefix_lens, extend_lens, page_tables)


def test_descending_pages_and_lengths_that_do_not_divide_the_page_size():
    plan = plan_paged_kv(
        prefix_lens=[0, 5, 3], extend_seq_lens=[5, 1, 6], page_tables=[[9, 7], [30, 2, 17], [4, 3, 8]], page_size=4
    )
    assert plan.qo_indptr.tolist() == [0, 5, 6, 12]
    assert plan.kv_indptr.tolist() == [0, 2, 4, 7]
    assert plan.kv_indices.tolist() == [9, 7, 30, 2, 4, 3, 8]  # request 1 uses 2 of its 3 pages
    assert plan.kv_last_page_len.tolist() == [1, 2, 1]
    assert plan.forward_mode is ForwardMode.EXTEND


def test_full_last_page_has_length_page_size_not_zero():
    plan = plan_paged_kv([4], [4], [[6, 1, 5]], page_size=4)
    assert plan.kv_indptr.tolist() == [0, 2] and plan.kv_indices.tolist() == [6, 1]
    assert plan.kv_last_page_len.tolist() == [4]


def test_page_size_one_makes_page_ids_the_token_slots():
    tables = [[5, 0, 3], [8, 2]]
    plan = plan_paged_kv([2, 0], [1, 2], tables, page_size=1)
    assert plan.kv_indices.tolist() == [5, 0, 3, 8, 2]
    assert plan.kv_last_page_len.tolist() == [1, 1]


def test_decode_mode_needs_one_token_after_a_prefix_for_every_request():
    assert plan_paged_kv([3, 9], [1, 1], [[0], [1, 2, 3]], 4).forward_mode is ForwardMode.DECODE
    assert plan_paged_kv([3, 0], [1, 1], [[0], [1]], 4).forward_mode is ForwardMode.EXTEND  # a 1-token prompt
    assert plan_paged_kv([3, 9], [1, 2], [[0], [1, 2, 3]], 4).forward_mode is ForwardMode.EXTEND
    empty = plan_paged_kv([], [], [], 4)
    assert empty.forward_mode is ForwardMode.EXTEND and empty.batch_size == 0 and empty.qo_indptr.tolist() == [0]


@pytest.mark.parametrize(
    "args, message",
    [
        (([0], [5], [[1]], 4), "needs 2 pages"),
        (([2], [0], [[1]], 4), "at least one new token"),
        (([0, 1], [1], [[1]], 4), "one of each per request"),
        (([0], [1], [[1]], 0), "page_size must be positive"),
    ],
)
def test_bad_inputs_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        plan_paged_kv(*args)


def test_real_flashinfer_get_seq_lens_agrees():
    flashinfer = pytest.importorskip("flashinfer")
    plan = plan_paged_kv([0, 5, 3, 7], [5, 1, 6, 1], [[9, 7], [30, 2], [4, 3, 8], [1, 6]], page_size=4)
    assert flashinfer.get_seq_lens(plan.kv_indptr, plan.kv_last_page_len, 4).tolist() == [5, 6, 9, 8]


def test_window_left_is_inclusive():
    assert window_left_of(None) == -1
    assert window_left_of(16) == 15  # HF keeps kv > q - 16, i.e. kv >= q - 15
    with pytest.raises(ValueError):
        window_left_of(0)


def _layer(idx, scaling=0.25, window=None, softcap=None, heads=(4, 2), dims=(16, 16)):
    return AttentionLayerInfo(idx, heads[0], LayerKVShape(heads[1], *dims), scaling, window, softcap)


def test_layers_group_by_window_softcap_scale_and_shape():
    layers = [
        _layer(0, window=8, softcap=50.0),
        _layer(1, softcap=50.0),
        _layer(2, window=8, softcap=50.0),
        _layer(3, scaling=0.125, softcap=50.0),
        _layer(4, softcap=50.0, dims=(16, 32)),
        _layer(5, softcap=50.0),
    ]
    groups = group_layers(layers)
    assert [g.layer_ids for g in groups] == [(0, 2), (1, 5), (3,), (4,)]
    assert groups[0] == PlanGroup((0, 2), 4, 2, 16, 16, window_left=7, logits_soft_cap=50.0, sm_scale=0.25)
    assert groups[1].window_left == -1 and groups[2].sm_scale == 0.125
    assert not groups[3].has_decode_kernel and groups[0].has_decode_kernel
    assert layer_to_group_index(groups, 6) == [0, 1, 0, 2, 3, 1]
    with pytest.raises(ValueError, match="no plan group"):
        layer_to_group_index(groups[:3], 6)


@pytest.mark.parametrize(
    "family, expected",
    [
        ("llama", [((0, 1), -1, None, 16**-0.5)]),
        ("qwen2", [((0,), -1, None, 16**-0.5), ((1,), 15, None, 16**-0.5)]),
        ("gemma2", [((0,), 15, 0.5, 24**-0.5), ((1,), -1, 0.5, 24**-0.5)]),
        ("gpt2", [((0,), -1, None, 16**-0.5), ((1,), -1, None, 16**-0.5 / 2)]),  # scale_attn_by_inverse_layer_idx
    ],
)
def test_probed_model_layers_form_the_expected_groups(family, expected):
    from nnrun.attention import ATTN_IMPLEMENTATION

    model = make_model(family)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    groups = group_layers(probe_attention_layers(model, torch.device("cpu")))
    got = [(g.layer_ids, g.window_left, g.logits_soft_cap, g.sm_scale) for g in groups]
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    assert [g[3] for g in got] == pytest.approx([e[3] for e in expected])


def test_engine_forward_batch_plans_the_slots_the_runner_writes():
    """Pages come from the scheduler's page tables; the planned pages must cover exactly kv_slots."""
    with nnrun.LLM(make_model("llama"), page_size=4, num_pages=64) as llm:
        runner = llm.runner
        runner.allocator._free_pages.reverse()  # hand out high page ids first: descending tables
        prompts = random_prompts([5, 1, 9, 4])
        reqs = [llm.make_request(p, nnrun.SamplingParams(max_tokens=1)) for p in prompts]
        for req in reqs:
            req.page_ids = runner.allocator.alloc(runner.allocator.pages_needed(req.num_tokens))
            req.req_pool_idx = runner.req_to_token_pool.alloc()
        runner.prepare_forward_batch_extend(reqs)  # records every token's slot in the request table
        reqs[2].num_computed_tokens = 6  # a cached prefix followed by a 3-token chunk
        forward_batch = runner.prepare_forward_batch_extend(reqs)
        plan = plan_forward_batch(forward_batch, page_size=4)
        assert reqs[0].page_ids == [63, 62]
        for b, slots in enumerate(forward_batch.kv_slots):
            assert _token_slots(plan, b) == slots.tolist()
        assert plan.qo_indptr.tolist() == [0, *torch.tensor(forward_batch.extend_seq_lens).cumsum(0).tolist()]
        new_slots = [slot for b, p in enumerate(forward_batch.prefix_lens) for slot in _token_slots(plan, b)[p:]]
        assert new_slots == forward_batch.out_cache_loc.tolist()
        assert plan.forward_mode is ForwardMode.EXTEND

        for req in reqs:
            req.num_computed_tokens = req.num_tokens - 1  # the 1-token prompt stays a prefill
        decode = [req for req in reqs if req.num_computed_tokens > 0]
        assert plan_forward_batch(runner.prepare_forward_batch_decode(decode), 4).forward_mode is ForwardMode.DECODE
        as_extend = plan_forward_batch(runner.prepare_forward_batch_extend(decode), 4)
        assert as_extend.forward_mode is ForwardMode.EXTEND  # the runner's label wins
        with pytest.raises(ValueError, match="DECODE step"):
            plan_forward_batch(runner.prepare_forward_batch_decode(reqs), 4)
        for req in reqs:
            runner.release_kv(req)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_decode_planned_from_its_table_equals_the_per_request_plan(page_size):
    """Large decode steps are planned from the request table's rows; every field equals the per-request plan."""
    from nnrun.attention.flashinfer_plan import plan_decode_from_table

    generator = torch.Generator().manual_seed(page_size)
    seq_lens = torch.randint(2, 40, (64,), generator=generator).tolist()  # each has a prefix: a decode step
    seq_lens[0] = 2
    seq_lens[1] = 2 * page_size
    page_ids = [torch.randperm(200, generator=generator)[: -(-n // page_size)].tolist() for n in seq_lens]
    width = max(seq_lens)
    table = torch.randint(0, 1000, (len(seq_lens), width), generator=generator)  # stale past each row's end
    for row, (seq_len, pages) in enumerate(zip(seq_lens, page_ids)):
        positions = torch.arange(seq_len)
        table[row, :seq_len] = torch.tensor(pages)[positions // page_size] * page_size + positions % page_size
    want = plan_paged_kv([n - 1 for n in seq_lens], [1] * len(seq_lens), page_ids, page_size)
    got = plan_decode_from_table(table, torch.tensor(seq_lens) - 1, page_size)
    assert got.forward_mode is want.forward_mode is ForwardMode.DECODE
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert getattr(got, name).dtype == torch.int32
        assert torch.equal(getattr(got, name), getattr(want, name)), name
