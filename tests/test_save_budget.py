"""Saved values past the device budget go to the host unchanged; a trace past the host budget fails alone.

Oracles: the same trace on an engine whose budgets never bind (bitwise), and nnsight on HF.
"""

from __future__ import annotations

import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

import interleaver.save_spill as save_spill
import nnrun
from nnrun.config import CacheConfig
from nnrun.kv_sizing import GiB, kv_budget_bytes
from nnrun.save_budget import SaveBudget, SaveBudgetError

PROMPT = "The Eiffel Tower is in"
DEVICE_BYTES = 2048  # under three rows of one layer (192 floats each): most saves go to the host
WAIT_S = 60


@pytest.fixture(scope="module")
def roomy():
    model = nnrun.LanguageModel("tiny-facts")
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def spilling():
    model = nnrun.LanguageModel("tiny-facts", saved_values_device_bytes=DEVICE_BYTES, saved_values_host_bytes=1 << 30)
    yield model
    model.shutdown()


def ledger_of(model) -> save_spill.SavedValueLedger:
    return model.engine.runner.nnsight_requests.saved_values


def assert_nothing_counted(model) -> None:
    ledger = ledger_of(model)
    deadline = time.monotonic() + WAIT_S
    while ledger.budget.num_traces and time.monotonic() < deadline:  # the engine thread finishes the trace
        time.sleep(0.01)
    with model.engine.runner.step_lock:
        budget = ledger.budget
        assert (budget.device_bytes, budget.host_bytes, budget.num_traces) == (0, 0, 0)
        assert not ledger._placed


@pytest.fixture
def host_copies(monkeypatch) -> list[torch.Size]:
    """The shapes of the saved values moved to the host."""
    shapes: list[torch.Size] = []
    real = save_spill._to_host

    def counting(tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        shapes.append(tensor.shape)
        return real(tensor, pin_memory)

    monkeypatch.setattr(save_spill, "_to_host", counting)
    return shapes


def generation_saves(model) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three layers' outputs every step (a list), and the last step's last row (a name bound again each step)."""
    with model.generate(PROMPT, max_new_tokens=5, min_new_tokens=5) as tracer:
        outputs = list().save()
        for _ in tracer.all():
            for layer in model.model.layers[:3]:
                outputs.append(layer.output)
            last_row = model.model.layers[3].output[:, -1].save()
    return outputs, last_row


def test_values_moved_to_the_host_equal_those_kept_on_the_device_bitwise(roomy, spilling, host_copies):
    budget = ledger_of(spilling).budget
    peak = [0]
    real_hold = budget.hold

    def watching(key: int, num_bytes: int, on_host: bool) -> None:
        real_hold(key, num_bytes, on_host)
        peak[0] = max(peak[0], budget.device_bytes)

    budget.hold = watching
    try:
        spilled = generation_saves(spilling)
    finally:
        del budget.hold
    num_moved = len(host_copies)
    kept = generation_saves(roomy)
    assert len(host_copies) == num_moved  # the roomy engine's saves all stay where they are
    assert num_moved >= len(spilled[0]) - 2  # all but what 2048 bytes hold went to the host
    assert 0 < peak[0] <= DEVICE_BYTES
    assert len(spilled[0]) == len(kept[0]) == 3 * 5
    for ours, reference in zip([*spilled[0], *spilled[1:]], [*kept[0], *kept[1:]]):
        assert ours.dtype == reference.dtype and ours.shape == reference.shape
        assert torch.equal(ours, reference)
    assert spilled[1]._base is None  # the moved row is a compact copy, not a view pinning its step
    assert_nothing_counted(spilling)
    assert_nothing_counted(roomy)


def test_a_value_moved_to_the_host_matches_nnsight_on_hf():
    import nnsight

    model = nnrun.LanguageModel("tiny-facts", saved_values_device_bytes=0)
    try:
        with model.trace(PROMPT):
            ours = model.model.layers[1].output.save()
            ours_logits = model.lm_head.output.save()
        assert ledger_of(model).budget.max_device_bytes == 0
        assert_nothing_counted(model)
    finally:
        model.shutdown()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference_model = nnsight.LanguageModel(str(nnrun.bundled_model_path("tiny-facts")), dispatch=True)
    with reference_model.trace(PROMPT):
        theirs = reference_model.model.layers[1].output.save()
        theirs_logits = reference_model.lm_head.output.save()
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    assert ours.device.type == "cpu" and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_logits, theirs_logits)


def co_scheduled(model, callers: list, num_requests: int) -> list:
    """Run each caller on its own thread so that their requests enter one step together."""
    results: list = [None] * len(callers)

    def call(index: int) -> None:
        try:
            results[index] = callers[index]()
        except BaseException as error:  # the caller's own outcome, checked by the test
            results[index] = error

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(callers))]
    with model.engine.paused():
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + WAIT_S
        while model.engine.num_requests_in_flight < num_requests:
            assert time.monotonic() < deadline, "the callers did not submit their requests"
            time.sleep(0.005)
    for thread in threads:
        thread.join(WAIT_S)
    return results


def last_rows(model) -> list[torch.Tensor]:
    with model.generate("Rome is in", max_new_tokens=4, min_new_tokens=4) as tracer:
        rows = list().save()
        for _ in tracer.all():
            rows.append(model.model.layers[0].output[:, -1])
    return rows


def test_a_trace_past_the_host_budget_fails_alone_and_names_the_budget(roomy, spilling):
    def greedy():
        with spilling.trace(PROMPT):
            logits = spilling.lm_head.output.save()  # [1, T, V] floats: more than both budgets
            assert logits is not None

    expected = last_rows(roomy)
    budget = ledger_of(spilling).budget
    with spilling.engine.runner.step_lock:
        budget.max_host_bytes = 4096  # room for the modest trace's rows (768 bytes each), not for the logits
    try:
        greedy_error, rows = co_scheduled(spilling, [greedy, lambda: last_rows(spilling)], 2)
    finally:
        with spilling.engine.runner.step_lock:
            budget.max_host_bytes = 1 << 30
    assert isinstance(greedy_error, SaveBudgetError), greedy_error
    assert "saved_values_host_bytes=4096" in str(greedy_error) and "Raise saved_values_host_bytes" in str(greedy_error)
    assert isinstance(rows, list) and len(rows) == len(expected) == 4
    for ours, theirs in zip(rows, expected):  # (batched with another prompt, a step's sums may round differently)
        torch.testing.assert_close(ours, theirs)
    assert_nothing_counted(spilling)
    with spilling.trace(PROMPT):  # the engine goes on serving
        hidden = spilling.model.layers[0].output.save()
    assert hidden.shape[-1] == 192
    assert_nothing_counted(spilling)


def test_nothing_stays_counted_after_a_block_fails(spilling):
    with pytest.raises(ValueError, match="on purpose"):
        with spilling.generate(PROMPT, max_new_tokens=4) as tracer:
            kept = list().save()
            for step in tracer.iter[:]:
                kept.append(spilling.model.layers[1].output)
                if step == 2:
                    raise ValueError("on purpose")
    assert_nothing_counted(spilling)


def test_nothing_stays_counted_after_an_abort(spilling):
    engine = spilling.engine
    outcome: list = []

    def long_generation() -> None:
        try:
            with spilling.generate(PROMPT, max_new_tokens=100, min_new_tokens=100) as tracer:
                kept = list().save()
                for _ in tracer.all():
                    kept.append(spilling.model.layers[1].output)
                    time.sleep(0.01)
        except BaseException as error:  # the abort's error, reported to this caller
            outcome.append(error)

    thread = threading.Thread(target=long_generation, daemon=True)
    thread.start()
    budget = ledger_of(spilling).budget
    deadline = time.monotonic() + WAIT_S
    while budget.host_bytes == 0:  # some of its saves are on the host: it is well under way
        assert time.monotonic() < deadline, "the generation never saved past the device budget"
        time.sleep(0.01)
    with engine.runner.step_lock:
        request_ids = list(engine.runner.nnsight_requests.request_to_invocations)
    engine.abort(request_ids, RuntimeError("aborted by the test"))
    thread.join(WAIT_S)
    assert outcome and "aborted by the test" in str(outcome[0])
    assert_nothing_counted(spilling)


def test_the_budget_counts_places_and_releases():
    budget = SaveBudget(max_device_bytes=100, max_host_bytes=50)
    assert budget.place(1, 60) is False and budget.place(1, 40) is False  # the device holds 100
    assert budget.place(2, 30) is True  # past the device budget: the host
    with pytest.raises(SaveBudgetError, match="saved_values_host_bytes=50"):
        budget.place(2, 30)
    assert (budget.device_bytes, budget.host_bytes) == (100, 30)
    budget.clear(1)
    assert budget.place(2, 30) is False
    budget.clear(2)
    assert (budget.device_bytes, budget.host_bytes, budget.num_traces) == (0, 0, 0)


@pytest.mark.parametrize("field", ["saved_values_device_bytes", "saved_values_host_bytes"])
def test_budgets_are_validated_naming_the_field(field):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"CacheConfig.{field}"):
            CacheConfig(**{field: bad})
    assert getattr(CacheConfig(**{field: 0}), field) == 0


def test_the_device_budget_for_saved_values_is_left_out_of_the_kv_pool():
    assert kv_budget_bytes(80 * GiB, 60 * GiB, 0.9, 4 * GiB) == 48 * GiB
    assert kv_budget_bytes(80 * GiB, 60 * GiB, 0.9, 4 * GiB, 4 * GiB) == 44 * GiB
    with pytest.raises(ValueError, match="saved_values_device_bytes"):
        kv_budget_bytes(80 * GiB, 60 * GiB, 0.9, 4 * GiB, 48 * GiB)


def test_the_ledger_counts_what_a_step_appended_and_uncounts_what_died():
    ledger = save_spill.SavedValueLedger(SaveBudget(max_device_bytes=64, max_host_bytes=1 << 20))
    job = SimpleNamespace(invocations=[], client_saves=[[]])
    saved = job.client_saves[0]
    base = torch.arange(64, dtype=torch.float32).reshape(4, 16).clone()  # [4, 16]
    saved.append(base[0])  # 64 bytes, a view: the device budget holds it as it is
    saved.append(base[1:3])  # 128 bytes: past the device budget, a compact host copy
    assert ledger.account([job]) == {}
    assert saved[0]._base is base and saved[1]._base is None and torch.equal(saved[1], base[1:3])
    assert (ledger.budget.device_bytes, ledger.budget.host_bytes) == (64, 128)
    saved.append(base[3])  # only the new item is looked at
    ledger.account([job])
    assert (ledger.budget.device_bytes, ledger.budget.host_bytes) == (64, 192)
    del saved[1:]  # the host values die: the next pass uncounts them
    ledger.account([job])
    assert (ledger.budget.device_bytes, ledger.budget.host_bytes) == (64, 0)
    ledger.release(job)
    assert (ledger.budget.device_bytes, ledger.budget.host_bytes, ledger.budget.num_traces) == (0, 0, 0)


def test_a_steps_appended_values_counted_together_are_counted_as_one_by_one():
    """Many values appended in one step that all fit are counted with one sum: the same totals, and each is
    still uncounted when it dies; past the device budget they are placed one by one."""
    ledger = save_spill.SavedValueLedger(SaveBudget(max_device_bytes=1000, max_host_bytes=1 << 20))
    job = SimpleNamespace(invocations=[], client_saves=[[]])
    saved = job.client_saves[0]
    values = [torch.zeros(4) for _ in range(20)]  # 16 bytes each
    saved.extend(values[:10])
    saved.append(values[0])  # held twice: counted once
    assert ledger.account([job]) == {}
    assert (ledger.budget.device_bytes, ledger.budget.host_bytes) == (160, 0)
    saved[3] = None  # a counted value dies
    del values[3]  # (`values[10:]` are the 9 values from the 11th on now)
    saved.extend(values[10:])
    saved.append(torch.zeros(250))  # 1000 bytes: the step's values no longer fit together
    assert ledger.account([job]) == {}
    assert (ledger.budget.device_bytes, ledger.budget.host_bytes) == (144 + 9 * 16, 1000)
    assert all(t is v for t, v in zip(saved[11:20], values[10:])) and saved[-1]._base is None
    ledger.release(job)
    assert (ledger.budget.device_bytes, ledger.budget.host_bytes, ledger.budget.num_traces) == (0, 0, 0)


@pytest.mark.gpu
def test_on_cuda_values_past_the_device_budget_are_pinned_host_copies_equal_to_device_ones():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kwargs = {"device": "cuda", "dtype": torch.float32, "attention_backend": "torch"}
    spilling = nnrun.LanguageModel("tiny-facts", saved_values_device_bytes=DEVICE_BYTES, **kwargs)
    roomy = nnrun.LanguageModel("tiny-facts", **kwargs)
    try:
        spilled, kept = generation_saves(spilling), generation_saves(roomy)
        moved = [value for value in spilled[0] if value.device.type == "cpu"]
        assert len(moved) >= len(spilled[0]) - 2 and all(value.is_pinned() for value in moved)
        assert all(value.device.type == "cuda" for value in kept[0])
        for ours, reference in zip([*spilled[0], spilled[1]], [*kept[0], kept[1]]):
            assert torch.equal(ours.cpu(), reference.cpu())
        assert_nothing_counted(spilling)
        assert ledger_of(roomy).budget.max_device_bytes == int(torch.cuda.get_device_properties(0).total_memory * 0.05)
    finally:
        spilling.shutdown()
        roomy.shutdown()


def _held_bytes(values: list) -> int:
    """The bytes the saved tensors hold, by hand: each distinct tensor's elements times their size."""
    distinct = {id(t): t for t in values if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in distinct.values())


def test_a_value_deleted_below_a_lists_end_leaves_the_next_values_counted():
    """`del saved[i]` below the end the last pass reached, then new values appended: every value still held is
    counted (the ledger does not take the list's length for how much of it it has seen)."""
    ledger = save_spill.SavedValueLedger(SaveBudget(max_device_bytes=1 << 20, max_host_bytes=1 << 20))
    job = SimpleNamespace(invocations=[], client_saves=[[]])
    saved = job.client_saves[0]
    saved.extend(torch.zeros(4) for _ in range(3))  # 16 bytes each
    ledger.account([job])
    assert ledger.budget.device_bytes == _held_bytes(saved) == 48
    del saved[0]  # it dies: uncounted at the next pass
    saved.append(torch.zeros(8))  # 32 bytes, at the position the last pass reached
    ledger.account([job])
    assert ledger.budget.device_bytes == _held_bytes(saved) == 64
    saved[1] = torch.zeros(2)  # a value replaced in place below the end (the old one dies)
    saved.append(torch.zeros(4))
    ledger.account([job])
    assert ledger.budget.device_bytes == _held_bytes(saved) == 16 + 8 + 32 + 16
    ledger.release(job)
    assert ledger.budget.num_traces == 0


class _Scope(dict):
    """A block's scope as the walk reads it: the names it bound (`written`)."""

    def __init__(self, **names) -> None:
        super().__init__(names)
        self.written = set(names)


def test_one_walk_copies_the_steps_views_and_counts_them_where_they_end_up():
    """`copy_and_account`: every saved view becomes a copy of its own (on the device while the budget lasts,
    else a compact host copy made from the view), each counted once, deletions below a list's end included."""
    from interleaver.nnsight_private import saved_value_ids

    ledger = save_spill.SavedValueLedger(SaveBudget(max_device_bytes=96, max_host_bytes=1 << 20))
    saved: list = []
    job = SimpleNamespace(invocations=[], client_saves=[saved])
    step = torch.arange(64, dtype=torch.float32).reshape(1, 16, 4)  # [1, N, H] a step's flat tensor
    named = step[:, 15]  # a name the block bound with `.save()`: 16 bytes
    saved_value_ids().add(id(named))
    scope = _Scope(row=named)
    block = SimpleNamespace(job=job, is_edit=False, is_finished=False, mediator=SimpleNamespace(lcls=scope))
    job.invocations.append(block)
    views = list(step.split(1, dim=1))  # 16 bytes each
    saved.extend(views[:8])  # with the name: 144 bytes, past the 96 the device holds
    try:
        assert ledger.copy_and_account([block]) == {}
        kept = [*saved, scope["row"]]
        assert all(t._base is None for t in kept) and all(torch.equal(t, v) for t, v in zip(saved, views))
        assert torch.equal(scope["row"], named) and id(scope["row"]) in saved_value_ids()
        assert (ledger.budget.device_bytes, ledger.budget.host_bytes) == (96, 144 - 96) == (96, _held_bytes(kept) - 96)
        del kept, saved[2]  # below the end the last pass reached: the value dies
        saved.extend(views[8:10])
        ledger.copy_and_account([block])
        kept = [*saved, scope["row"]]
        assert all(t._base is None for t in kept)
        assert ledger.budget.device_bytes + ledger.budget.host_bytes == _held_bytes(kept) == 160
    finally:
        saved_value_ids().discard(id(scope["row"]))
        ledger.release(job)
    assert (ledger.budget.device_bytes, ledger.budget.host_bytes, ledger.budget.num_traces) == (0, 0, 0)
