"""The state pool's bookkeeping (CPU, milliseconds): rows, lazy tensors, the token count that guards resumption."""

from __future__ import annotations

import pytest
import torch

from nnrun.state.pool import StatePool
from nnrun.state.step import Segment, StateStep

CPU = torch.device("cpu")


def test_a_state_is_read_back_per_row_and_absent_until_written():
    pool = StatePool(num_rows=3, device=CPU, mixer_layer_ids=[0])
    key = (0, "conv", 0)
    assert pool.read(key, torch.tensor([0])) is None
    pool.write(key, torch.tensor([2, 0]), torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]]))  # [2, 1, 2]
    assert pool.tensors[key].shape == (3, 1, 2)  # one row per request-table row, HF's shape after
    assert torch.equal(pool.read(key, torch.tensor([0, 2])), torch.tensor([[[3.0, 4.0]], [[1.0, 2.0]]]))
    assert torch.equal(pool.read(key, torch.tensor([1])), torch.zeros(1, 1, 2))


def test_the_pool_keeps_values_never_autograd_history():
    pool = StatePool(num_rows=2, device=CPU, mixer_layer_ids=[0])
    value = torch.ones(1, 4, requires_grad=True) * 2
    pool.write((0, "recurrent", 0), torch.tensor([1]), value)
    assert not pool.tensors[(0, "recurrent", 0)].requires_grad


def test_a_row_resumes_only_from_the_token_count_it_holds():
    pool = StatePool(num_rows=2, device=CPU, mixer_layer_ids=[0])
    pool.num_tokens[1] = 7
    pool.check_holds(1, 7, "a")
    with pytest.raises(RuntimeError, match="holds 7"):
        pool.check_holds(1, 6, "a")
    pool.invalidate(1)
    with pytest.raises(RuntimeError, match="holds -1"):
        pool.check_holds(1, 7, "a")


def test_commit_counts_tokens_only_for_rows_every_mixer_layer_reached():
    pool = StatePool(num_rows=3, device=CPU, mixer_layer_ids=[0, 2])
    step = StateStep(pool, [Segment(row=0, start=0, num_new=4, prefix=0), Segment(1, 4, 1, 5)], num_mixer_layers=2)
    pool.num_tokens[1] = 5
    for layer_idx in (0, 2):
        step._hold(layer_idx, torch.tensor([0]), [((layer_idx, "conv", 0), torch.ones(1, 2))])
    step._hold(0, torch.tensor([1]), [((0, "conv", 0), torch.full((1, 2), 3.0))])  # layer 2 never ran on row 1
    step.commit()
    assert pool.num_tokens[:2] == [4, -1]  # row 1's state is half a step ahead: unusable, never resumed from
    assert torch.equal(pool.tensors[(2, "conv", 0)][0], torch.ones(2))


def test_a_module_writes_back_only_the_states_it_used():
    """Several modules of one layer may keep states under one layer_idx (a state index each): none clobbers another's."""
    from nnrun.state.hf_cache import rows_cache, written_states

    pool = StatePool(num_rows=2, device=CPU, mixer_layer_ids=[1])
    rows = torch.tensor([0])
    for state_idx in (0, 1):
        pool.write((1, "conv", state_idx), rows, torch.full((1, 3, 4), float(state_idx)))
    pool.num_tokens[0] = 5
    cache, layer = rows_cache(pool, 1, num_states=2, rows=rows, continues=True)
    conv = cache.get_conv_state(1, state_idx=1)  # HF's decode path updates this tensor in place
    conv += 10
    assert [key for key, _ in written_states(1, cache, layer)] == [(1, "conv", 1)]
    assert torch.equal(written_states(1, cache, layer)[0][1], torch.full((1, 3, 4), 11.0))


def test_a_fresh_prefill_reads_no_state_and_leaves_hf_its_empty_cache():
    from nnrun.state.hf_cache import rows_cache

    pool = StatePool(num_rows=2, device=CPU, mixer_layer_ids=[0])
    pool.write((0, "recurrent", 0), torch.tensor([1]), torch.ones(1, 2, 2))  # a previous request's state in row 1
    cache, _ = rows_cache(pool, 0, num_states=1, rows=torch.tensor([1]), continues=False)
    assert cache.get_conv_state(0) is None and cache.get_recurrent_state(0) is None


def test_a_mixer_keeping_its_state_on_itself_runs_on_the_rows_states_and_gets_its_own_back():
    """RecurrentGemma's blocks keep their states as attributes: HF's forward sees the rows', the module keeps its own."""
    from nnrun.state.bridges import ModuleAttributes
    from nnrun.state.hf_cache import rows_cache, written_states

    class Block(torch.nn.Module):  # HF's way: carries `conv1d_state` and `inner.state` on when use_cache
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Module()
            self.conv1d_state, self.inner.state = "its own", "its own"

        def forward(self, hidden, use_cache=False):
            assert use_cache
            seen = (self.conv1d_state, self.inner.state)
            self.conv1d_state, self.inner.state = hidden * 2, hidden * 3
            return seen

    pool = StatePool(num_rows=2, device=CPU, mixer_layer_ids=[0])
    rows = torch.tensor([1])
    pool.write((0, "conv", 0), rows, torch.ones(1, 2))
    pool.write((0, "recurrent", 0), rows, torch.full((1, 2), 5.0))
    bridge = ModuleAttributes((("conv", "conv1d_state"), ("recurrent", "inner.state")))
    block = Block()
    cache, layer = rows_cache(pool, 0, num_states=1, rows=rows, continues=True)
    seen = bridge.call(block, type(block).forward, 0, torch.ones(1, 2), cache, {})
    assert torch.equal(seen[0], torch.ones(1, 2)) and torch.equal(seen[1], torch.full((1, 2), 5.0))
    assert (block.conv1d_state, block.inner.state) == ("its own", "its own")
    written = dict(written_states(0, cache, layer))
    assert torch.equal(written[(0, "conv", 0)], torch.full((1, 2), 2.0))
    assert torch.equal(written[(0, "recurrent", 0)], torch.full((1, 2), 3.0))
    fresh, _ = rows_cache(pool, 0, num_states=1, rows=rows, continues=False)  # a fresh prefill: HF starts from None
    assert bridge.call(block, type(block).forward, 0, torch.ones(1, 2), fresh, {}) == (None, None)
