"""PackedBatcher: per-request views, gathers and writes over explicit spans (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from interleaver.batcher import NO_SKIP, PackedBatcher, PackedGroup, ShapeMismatchError

LM_HEAD = "model.lm_head"


def batcher_at(location: str, num_tokens=9, num_logits=4, num_rows=3) -> PackedBatcher:
    batcher = PackedBatcher(LM_HEAD)
    batcher.set_step(num_tokens, num_logits, num_rows)
    batcher.location = location
    return batcher


def flat(num_tokens=9, hidden=4) -> torch.Tensor:
    return torch.arange(num_tokens * hidden, dtype=torch.float32).reshape(1, num_tokens, hidden)  # [1, N, H]


# requests: r0 tokens 0..4 (prefill of 5), r1 token 5 (decode), r2 tokens 6..8 (prefill of 3)
R0 = PackedGroup([(0, 5)], [(0, 1)], [0])
R1 = PackedGroup([(5, 1)], [(1, 1)], [1])
R0_R2 = PackedGroup([(0, 5), (6, 3)], [(0, 1), (2, 2)], [0, 2])


def test_single_request_read_is_a_marked_view_of_its_tokens():
    batcher, value = batcher_at("model.model.layers.0.output"), flat()
    served = batcher.narrow(value, R1)
    assert served.shape == (1, 1, 4) and served._nnsight_batch
    assert torch.equal(served, value[:, 5:6])
    served[:] = -1  # an in-place edit lands in the flat batch
    assert (value[0, 5] == -1).all() and (value[0, 4] != -1).all()


def test_several_requests_are_gathered_left_padded_and_scattered_back():
    batcher, value = batcher_at("model.model.layers.0.output"), flat()
    served = batcher.narrow(value, R0_R2)
    assert served.shape == (2, 5, 4)
    assert torch.equal(served[0], value[0, 0:5]) and torch.equal(served[1, 2:], value[0, 6:9])
    assert (served[1, :2] == 0).all()
    served[:] = 7.0
    batcher.scatter_back(value, R0_R2, served)
    assert (value[0, 0:5] == 7).all() and (value[0, 6:9] == 7).all() and (value[0, 5] != 7).all()


R1_R2_DECODE = PackedGroup([(5, 1), (6, 1)], [(1, 1), (2, 1)], [1, 2])  # two adjacent one-token spans


def test_adjacent_equal_spans_are_served_as_a_view_with_nothing_to_scatter_back():
    batcher, value = batcher_at("model.model.layers.0.output"), flat()
    with torch.no_grad():
        served = batcher.narrow(value, R1_R2_DECODE)
    assert served.shape == (2, 1, 4) and torch.equal(served[:, 0], value[0, 5:7])
    assert served.data_ptr() == value[0, 5].data_ptr()  # no gather: a view of the flat tensor
    served += 1  # lands in the flat batch at once
    assert torch.equal(value[0, 5:7], flat()[0, 5:7] + 1) and torch.equal(value[0, :5], flat()[0, :5])
    batcher.scatter_back(value, R1_R2_DECODE, served)  # nothing to write (and nothing written twice)
    assert torch.equal(value[0, 5:7], flat()[0, 5:7] + 1)


def test_spans_that_need_padding_or_autograd_are_still_gathered():
    batcher, value = batcher_at("model.model.layers.0.output"), flat()
    with torch.no_grad():
        unequal = batcher.narrow(value, PackedGroup([(4, 1), (5, 4)], [(0, 1), (1, 1)], [0, 1]))
    assert unequal.shape == (2, 4, 4) and unequal._base is None  # left-padded: a gathered copy
    with torch.enable_grad():
        tracked = batcher.narrow(value.clone().requires_grad_(), R1_R2_DECODE)
    assert tracked._base is None  # a copy, which carries the read's gradient


def test_adjacent_rows_are_served_as_a_view():
    batcher = batcher_at("model.samples")
    rows = torch.tensor([3, 4, 5])  # [B]
    with torch.no_grad():
        served = batcher.narrow(rows, R1_R2_DECODE)
    assert served.tolist() == [4, 5] and served._base is rows
    served[0] = 9
    batcher.scatter_back(rows, R1_R2_DECODE, served)
    assert rows.tolist() == [3, 9, 5]
    assert batcher.narrow(rows, R0_R2)._base is None  # rows 0 and 2 are not adjacent: a copy


def test_assignment_replaces_only_its_tokens_and_leaves_earlier_reads_intact():
    batcher, value = batcher_at("model.model.layers.0.output"), flat()
    before = batcher.narrow(value, R0)
    kept = before.clone()
    updated = batcher.widen(value, R0, torch.zeros(1, 5, 4))
    assert updated is not value and (updated[0, :5] == 0).all() and torch.equal(updated[0, 5:], value[0, 5:])
    assert torch.equal(before, kept)


def test_wrong_shape_assignment_names_module_and_both_shapes():
    batcher = batcher_at("model.model.layers.3.mlp.output")
    with pytest.raises(ShapeMismatchError, match=r"model\.model\.layers\.3\.mlp.*\(1, 2, 4\).*\(1, 5, 4\)"):
        batcher.widen(flat(), R0, torch.zeros(1, 2, 4))


def test_layout_comes_from_the_location():
    batcher = batcher_at("model.lm_head.output")
    logits = torch.randn(1, 4, 10)  # [1, R, V]: the LM head runs on the kept positions only
    assert torch.equal(batcher.narrow(logits, R0_R2)[1], logits[0, 2:4])
    batcher.location = "model.logits"
    rows = torch.randn(3, 10)  # [B, V]
    assert torch.equal(batcher.narrow(rows, R1), rows[1:2])
    assert torch.equal(batcher.narrow(rows, R0_R2), rows[[0, 2]])
    replaced = batcher.widen(rows, R0_R2, torch.zeros(2, 10))
    assert (replaced[[0, 2]] == 0).all() and torch.equal(replaced[1], rows[1])


def test_values_that_are_not_per_token_pass_whole():
    batcher = batcher_at("model.model.layers.0.self_attn.input")
    other = torch.randn(9)  # e.g. a 1-D tensor that is not [1, N, ...]
    mask = torch.randn(2, 9, 4)
    served = batcher.narrow(((flat(),), {"extra": other, "mask": mask, "flag": True}), R1)
    assert served[0][0].shape == (1, 1, 4) and served[1]["extra"] is other and served[1]["mask"] is mask


def test_skip_of_every_token_builds_the_output_and_a_partial_skip_is_spliced():
    batcher = batcher_at("model.model.layers.1.skip", num_tokens=6)
    first, second = PackedGroup([(0, 5)], [(0, 1)], [0]), PackedGroup([(5, 1)], [(1, 1)], [1])
    running = batcher.gather_skip(NO_SKIP, second, torch.full((1, 1, 4), 2.0))
    running = batcher.gather_skip(running, first, torch.full((1, 5, 4), 1.0))
    whole = batcher.assemble_skip(running)
    assert whole.shape == (1, 6, 4) and (whole[0, :5] == 1).all() and (whole[0, 5] == 2).all()

    partial = batcher.gather_skip(NO_SKIP, second, torch.full((1, 1, 4), 2.0))
    assert batcher.assemble_skip(partial) is NO_SKIP  # the module runs for the others ...
    body_output = torch.zeros(1, 6, 4)
    spliced = batcher.splice_skips("model.model.layers.1.output", body_output)  # ... and the skip is put in
    assert (spliced[0, :5] == 0).all() and (spliced[0, 5] == 2).all()
    with pytest.raises(ShapeMismatchError, match="does not cover"):
        batcher.gather_skip(NO_SKIP, first, torch.zeros(1, 3, 4))
