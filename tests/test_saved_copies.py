"""End-of-step copies of saved views (interleaver/saved_copies.py): each its own storage, and nothing skipped.

The pass copies a step's views with one `torch._foreach_copy_` into fresh tensors, and walks a saved
list only from where an earlier pass left it owned: these tests check, against the views themselves,
that the copies hold the same values in storage of their own, and that a view put anywhere a later
pass cannot skip (below the list's end, inside a container item) is still copied.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from interleaver.saved_copies import unpin_client_saves


def _owns_storage(tensor: torch.Tensor) -> bool:
    return tensor._base is None and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_each_saved_view_becomes_a_copy_of_its_own_with_the_views_values():
    step = torch.arange(48, dtype=torch.float32).reshape(1, 12, 4)  # [1, N, H] a step's flat tensor
    views = list(step.split([3, 5, 4], dim=1))  # each request's [1, T_i, H]
    saved = [views[0], views[1], views[0]]  # one view held twice
    named = {"last": views[2], "first": views[0]}
    job = SimpleNamespace(client_saves=[saved, named])
    unpin_client_saves([job], {}, {})
    for copy, view in zip(saved, [views[0], views[1], views[0]]):
        assert _owns_storage(copy) and torch.equal(copy, view)
    assert saved[0] is saved[2] and named["first"] is saved[0]  # one copy per view, wherever it is held
    assert _owns_storage(named["last"]) and torch.equal(named["last"], views[2])
    pointers = {t.untyped_storage().data_ptr() for t in (saved[0], saved[1], named["last"])}
    assert len(pointers) == 3 and step.untyped_storage().data_ptr() not in pointers
    step.zero_()  # the step's tensor is reused: the saved values keep theirs
    assert saved[1].sum().item() == sum(range(12, 32))


def test_a_later_pass_copies_views_put_below_the_lists_end_or_inside_its_items():
    walked: dict = {}
    saved: list = []
    job = SimpleNamespace(client_saves=[saved])
    for step_index in range(3):  # three steps, each appending its read, as `tracer.all()` does
        step = torch.full((1, 2, 4), float(step_index))
        saved.append(step[:, 1:])
        unpin_client_saves([job], {}, walked)
        assert all(_owns_storage(t) for t in saved)
    late = torch.full((1, 2, 4), 7.0)
    saved[0] = late[:, :1]  # a view put below the end an earlier pass reached
    saved.append({"inner": late[:, 1:]})  # a container item, filled with a view
    unpin_client_saves([job], {}, walked)
    assert _owns_storage(saved[0]) and torch.equal(saved[0], late[:, :1])
    assert _owns_storage(saved[-1]["inner"])
    saved[-1]["inner"] = late[:, :1]  # the container changes in place at a later step
    unpin_client_saves([job], {}, walked)
    assert _owns_storage(saved[-1]["inner"]) and torch.equal(saved[-1]["inner"], late[:, :1])
    assert [t[0, 0, 0].item() for t in saved[1:3]] == [1.0, 2.0]


def test_a_view_with_a_gradient_is_copied_into_the_graph():
    weight = torch.ones(1, 4, 2, requires_grad=True)
    step = weight * 3.0  # [1, N, H] in a graph
    saved = [step[:, 1:3]]
    unpin_client_saves([SimpleNamespace(client_saves=[saved])], {}, {})
    copy = saved[0]
    assert copy._base is None and copy.grad_fn is not None
    copy.sum().backward()
    assert weight.grad[0, 1:3].eq(3.0).all() and weight.grad[0, 0].eq(0.0).all()


def test_a_list_that_gains_many_views_at_once_gets_a_copy_of_each_with_clones_strides():
    from interleaver.saved_copies import MIN_CLONED_TOGETHER

    walked: dict = {}
    saved: list = []
    job = SimpleNamespace(client_saves=[saved])
    for step_index in range(2):  # every request's read of every layer, appended in one step
        step = torch.randn(1, MIN_CLONED_TOGETHER, 6)  # [1, N, H]
        reads = list(step.split(1, dim=1)) + [step[:, :, ::2]]  # the last one strided, as a `.source` value may be
        saved.extend(reads)
        unpin_client_saves([job], {}, walked)
        for copy, view in zip(saved[-len(reads) :], reads):
            assert copy is not view and _owns_storage(copy) and torch.equal(copy, view)
            assert copy.stride() == view.clone().stride()
    assert len({t.untyped_storage().data_ptr() for t in saved}) == len(saved)
    twice = torch.randn(1, MIN_CLONED_TOGETHER, 2)
    view = twice[:, :1]
    saved.extend([view] * MIN_CLONED_TOGETHER)  # one view appended many times: still one copy, held everywhere
    unpin_client_saves([job], {}, walked)
    tail = saved[-MIN_CLONED_TOGETHER:]
    assert all(t is tail[0] for t in tail) and _owns_storage(tail[0]) and torch.equal(tail[0], view)
