"""The lean step (issue 15): no HF mask preparation inside a step, whole-batch step layouts, ungathered groups."""

from __future__ import annotations

import pytest
import torch
import transformers.masking_utils as masking_utils
from transformers.masking_utils import AttentionMaskInterface

import nnrun
from model_zoo import make_model, make_twin, random_prompts
from nnrun import forward_batch
from nnrun.attention import ATTN_IMPLEMENTATION
from nnrun.attention.step_layout import extend_groups
from nnrun.forward_batch import ForwardMode
from tolerance import assert_close_packed

GREEDY = nnrun.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_a_step_runs_no_hf_mask_preparation_and_plain_calls_still_mask(monkeypatch):
    calls = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda *a: calls.append(1) or real(*a))
    model = make_model("llama")
    with nnrun.LLM(model) as llm:
        calls.clear()  # the load-time probe is a plain call
        llm.generate(random_prompts([5, 3, 7]), GREEDY)
        assert calls == []  # neither the prefill nor the decode steps prepared a mask
        assert ATTN_IMPLEMENTATION in AttentionMaskInterface._global_mapping  # restored after each step
        # The same model called plainly on a left-padded batch still masks the padding, as sdpa does.
        ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
        mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        twin = make_twin(model)
        with torch.no_grad():
            ours = llm.model(ids, attention_mask=mask).logits[0, -1]
            expected = twin(ids, attention_mask=mask).logits[0, -1]
        assert_close_packed(ours, expected)


def test_decode_layout_equals_the_general_builder():
    """The decode fast path builds exactly what the general packed builder builds for the same requests."""
    with nnrun.LLM(make_model("llama"), page_size=4, num_pages=64) as llm:
        runner = llm.runner
        runner.allocator._free_pages.reverse()  # descending page ids
        reqs = [llm.make_request(p, GREEDY) for p in random_prompts([5, 1, 9, 4])]
        for req in reqs:
            req.page_ids = runner.allocator.alloc(runner.allocator.pages_needed(req.num_tokens))
            req.req_pool_idx = runner.req_to_token_pool.alloc()
        runner.prepare_forward_batch_extend(reqs)
        for req in reqs:
            req.num_computed_tokens = req.num_tokens
            req.output_token_ids.append(7)  # one more token: it may open a new page
            if runner.allocator.pages_needed(req.num_tokens) > len(req.page_ids):
                req.page_ids += runner.allocator.alloc(1)
        fast = runner.prepare_forward_batch_decode(reqs)
        for req in reqs:
            req.num_computed_tokens = req.num_tokens - 1
        general = runner._prepare_forward_batch(reqs, ForwardMode.DECODE)
        for name in ("input_ids", "positions", "out_cache_loc", "logits_indices"):
            assert getattr(fast, name).tolist() == getattr(general, name).tolist(), name
        assert [s.tolist() for s in fast.kv_slots] == [s.tolist() for s in general.kv_slots]
        assert (fast.extend_seq_lens, fast.prefix_lens, fast.next_token_logits_rows) == (
            general.extend_seq_lens,
            general.prefix_lens,
            general.next_token_logits_rows,
        )
        for req in reqs:
            runner.release_kv(req)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_small_and_large_step_layouts_agree_with_the_page_arithmetic(monkeypatch, page_size):
    """Plain-int and tensor layouts give each new token the slot its page holds it in, and the same batch."""
    with nnrun.LLM(make_model("llama"), page_size=page_size, num_pages=512) as llm:
        runner = llm.runner
        runner.allocator._free_pages.reverse()  # descending page ids: slots are not simply positions
        reqs = [llm.make_request(p, GREEDY) for p in random_prompts([5, 1, 23, 9, 4])]
        for req, cached in zip(reqs, [0, 0, 11, 3, 0]):  # some requests bring a cached prefix
            req.page_ids = runner.allocator.alloc(runner.allocator.pages_needed(req.num_tokens))
            req.req_pool_idx = runner.req_to_token_pool.alloc()
            req.num_computed_tokens = cached
        prefixes, seqs = [r.num_computed_tokens for r in reqs], [r.num_tokens for r in reqs]
        expected_positions = [pos for p, s in zip(prefixes, seqs) for pos in range(p, s)]
        expected_slots = [
            r.page_ids[pos // page_size] * page_size + pos % page_size
            for r, p, s in zip(reqs, prefixes, seqs)
            for pos in range(p, s)
        ]
        expected_rows = [r.req_pool_idx for r, p, s in zip(reqs, prefixes, seqs) for _ in range(s - p)]
        batches = []
        for layout, limit in ((forward_batch.token_layout_plain, 10**6), (forward_batch.token_layout_tensor, 0)):
            positions, slots, rows = layout(reqs, prefixes, seqs, page_size)
            assert (positions.tolist(), slots.tolist(), rows.tolist()) == (
                expected_positions,
                expected_slots,
                expected_rows,
            ), layout.__name__
            monkeypatch.setattr(forward_batch, "PLAIN_LAYOUT_MAX_TOKENS", limit)
            batches.append(runner.prepare_forward_batch_extend(reqs))
        plain, tensor = batches
        for name in ("input_ids", "positions", "out_cache_loc", "logits_indices"):
            assert getattr(plain, name).tolist() == getattr(tensor, name).tolist(), name
        assert [s.tolist() for s in plain.kv_slots] == [s.tolist() for s in tensor.kv_slots]
        for req, slots in zip(reqs, plain.kv_slots):  # the request table holds every slot of each request
            assert (
                slots[req.num_computed_tokens :].tolist() == expected_slots[: req.num_tokens - req.num_computed_tokens]
            )
            expected_slots = expected_slots[req.num_tokens - req.num_computed_tokens :]
        for req in reqs:
            runner.release_kv(req)


def test_adjacent_equal_prompts_attend_in_one_ungathered_call_and_match_solo_runs():
    model = make_model("llama")
    prompts = random_prompts([6, 6, 6, 6, 3])
    with nnrun.LLM(model) as llm:
        reqs = [llm.make_request(p, GREEDY) for p in prompts]
        for req in reqs:
            llm.runner._hold_kv(req)
        groups = extend_groups(llm.runner.prepare_forward_batch_extend(reqs), torch.device("cpu"))
        assert [(g.size, g.token_indices is None) for g in groups] == [(4, True), (1, True)]
        for req in reqs:
            llm.runner.release_kv(req)
        together = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
        alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.parametrize("page_size", [1, 4])
def test_advanced_decode_batch_equals_a_fresh_one_across_page_boundaries(page_size):
    """The engine's decode chain (positions and slots + 1, new pages looked up) builds what a fresh layout builds."""
    with nnrun.LLM(make_model("llama"), page_size=page_size, num_pages=256) as llm:
        runner = llm.runner
        runner.allocator._free_pages.reverse()  # descending page ids: a new page is never the next slot
        reqs = [llm.make_request(p, GREEDY) for p in random_prompts([5, 1, 9, 4, 7])]
        for req in reqs:
            runner._hold_kv(req)
        runner.prepare_forward_batch_extend(reqs)
        previous = None
        for step in range(2 * page_size + 3):
            tokens = [(7 * step + row) % 50 for row in range(len(reqs))]
            for req, token in zip(reqs, tokens):
                req.num_computed_tokens = req.num_tokens
                req.output_token_ids.append(token)
                runner._hold_kv(req)  # a page for the new position when it opens one
            fresh = runner.prepare_forward_batch_decode(reqs)
            if previous is not None:
                advanced = runner.advance_decode_batch(previous, torch.tensor(tokens))
                for name in ("input_ids", "positions", "out_cache_loc", "logits_indices", "kv_slot_table"):
                    assert torch.equal(getattr(advanced, name), getattr(fresh, name)), (step, name)
                assert [s.tolist() for s in advanced.kv_slots] == [s.tolist() for s in fresh.kv_slots]
                assert (advanced.prefix_lens, advanced.extend_seq_lens, advanced.seq_lens) == (
                    fresh.prefix_lens,
                    fresh.extend_seq_lens,
                    fresh.seq_lens,
                )
                fresh = advanced
            previous = fresh
        for req in reqs:
            runner.release_kv(req)


def test_steady_decode_steps_advance_the_last_one_and_a_changed_batch_is_built_afresh(monkeypatch):
    """Decode steps of an unchanged batch take the chain; a finished request breaks it (the batch is rebuilt)."""
    calls = []
    with nnrun.LLM(make_model("llama")) as llm:
        runner = llm.runner
        for name in ("advance_decode_batch", "prepare_forward_batch_decode"):
            inner = getattr(runner, name)
            monkeypatch.setattr(runner, name, lambda *a, _inner=inner, _name=name: calls.append(_name) or _inner(*a))
        prompts = random_prompts([5, 3, 7])
        params = [nnrun.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 3, 6)]
        outputs = llm.generate(prompts, params)
    # Decode steps 2..5 (the prefill gave token 1): a fresh batch, one advance, then the second request's
    # end changes the batch (fresh again) and the rest advance.
    assert calls == ["prepare_forward_batch_decode", "advance_decode_batch"] + [
        "prepare_forward_batch_decode",
        "advance_decode_batch",
        "advance_decode_batch",
    ]
    assert [len(out.outputs[0].token_ids) for out in outputs] == [6, 3, 6]
