"""Allocator, request table and KV pool bookkeeping."""

import pytest
import torch

from nnrun.memory import KVPool, LayerKVShape, ReqToTokenPool, TokenToKVPoolAllocator


def test_alloc_returns_none_when_exhausted_and_recovers_after_free():
    allocator = TokenToKVPoolAllocator(num_pages=4, page_size=8)
    first = allocator.alloc(3)
    assert len(first) == 3 and allocator.num_free_tokens == 8
    assert allocator.alloc(2) is None  # no exception, nothing taken
    assert allocator.num_free_pages == 1
    allocator.free(first)
    assert sorted(allocator.alloc(4)) == [0, 1, 2, 3]


def test_double_free_never_hands_one_page_out_twice():
    allocator = TokenToKVPoolAllocator(num_pages=3, page_size=2)
    pages = allocator.alloc(2)
    allocator.free(pages)
    allocator.free(pages)
    assert allocator.num_free_pages == 3
    taken = allocator.alloc(3)
    assert len(set(taken)) == 3 and allocator.alloc(1) is None


def test_leak_check_names_the_held_pages():
    allocator = TokenToKVPoolAllocator(num_pages=5, page_size=4)
    pages = allocator.alloc(2)
    with pytest.raises(AssertionError, match="2 of 5 pages"):
        allocator.check_no_leaks()
    allocator.free(pages)
    allocator.check_no_leaks()


def test_pages_needed_rounds_up():
    allocator = TokenToKVPoolAllocator(num_pages=1, page_size=16)
    assert [allocator.pages_needed(n) for n in (1, 16, 17, 32)] == [1, 1, 2, 2]


def test_req_to_token_rows():
    pool = ReqToTokenPool(max_num_reqs=2, max_context_len=8)
    row = pool.alloc()
    pool.write(row, 2, torch.tensor([7, 8, 9]))
    assert pool.slots(row, 5)[2:].tolist() == [7, 8, 9]
    other = pool.alloc()
    assert pool.alloc() is None
    pool.free(row)
    pool.free(row)
    assert pool.num_free_rows == 1 and other != row


def test_kv_pool_writes_by_slot_across_pages():
    shapes = [LayerKVShape(num_kv_heads=2, head_dim=4, v_head_dim=3)]
    pool = KVPool(shapes, num_pages=3, page_size=2, dtype=torch.float32, device=torch.device("cpu"))
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 3)
    slots = torch.tensor([5, 0, 3])  # page 2 offset 1, page 0 offset 0, page 1 offset 1
    pool.write(0, slots, k, v)
    assert torch.equal(pool.k_pages[0][2, 1], k[0]) and torch.equal(pool.v_pages[0][1, 1], v[2])
    assert KVPool.bytes_per_token(shapes, torch.float32) == 2 * (4 + 3) * 4
