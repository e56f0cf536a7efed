"""nnsight 0.8.1's last three LanguageModel tests (its tests/test_lm.py: test_batched_editing, test_skip_2,
test_scan_undispatched), ported to the bundled GPT-2 and run on nnsight over plain HF (the oracle) and on nnrun.

Each block runs inside a function, as in nnsight's suite: a saved name the trace failed to push is then an
`UnboundLocalError`, never a stale value.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from conformance.compare import assert_same
from conformance.models import bundled_pair
from interleaver.write_checks import InvalidWriteError

PROMPT = "the capital of france is"


class ComplexModule(torch.nn.Module):
    """nnsight's test attachment: a module with a submodule, called from a block with `hook=True`."""

    def __init__(self) -> None:
        super().__init__()
        from nnsight.modeling.transformers import WrapperModule

        self.one = WrapperModule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.one(x)


@pytest.fixture(scope="module")
def pair():
    oracle, ours = bundled_pair("tiny-facts-gpt2")
    yield oracle, ours
    ours.shutdown()


def both(pair, scenario, *args):
    """The scenario's values on nnsight over HF and on nnrun (nnsight's deprecation warnings silenced)."""
    oracle, ours = pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return scenario(oracle, *args), scenario(ours, *args)


# ---- test_batched_editing -------------------------------------------------------------------
def batched_editing(model, spelling):
    l0 = model.transformer.h[0]
    l0.attachment = ComplexModule()
    with model.edit() as (tracer, edited_model):
        if spelling == "whole output":
            l0.output[:] = l0.attachment(l0.output, hook=True)
        else:  # nnsight's own spelling (GPT-2 blocks returned tuples): on a tensor output, row 0
            acts = l0.output[0]
            l0.output[0][:] = l0.attachment(acts, hook=True)
    with edited_model.trace(["a", "b"]):
        edited = l0.attachment.output.save()
    return edited


@pytest.mark.parametrize("spelling", ["whole output", "first row"])
def test_batched_editing_saves_the_attachment_output(pair, spelling):
    expected, actual = both(pair, batched_editing, spelling)
    assert expected.shape[0] == 2  # nnsight's own assertion: the batch does not narrow
    assert_same(expected, actual, f"attachment output ({spelling})")


# ---- test_skip_2 ----------------------------------------------------------------------------
def skip_after_rebuilt_inputs(model):
    h = model.transformer.h
    with model.trace(PROMPT):
        inp = h[0].output.save()
        h[1].inputs = (torch.zeros_like(h[1].input),) + h[1].inputs[1:]
        h[1].skip(inp)
        out = h[1].output.save()
        logits = model.lm_head.output.save()
    return {"inp": inp, "out": out, "logits": logits}


def test_skip_wins_over_a_rebuilt_inputs_tuple(pair):
    expected, actual = both(pair, skip_after_rebuilt_inputs)
    assert not torch.all(actual["out"] == 0)
    assert torch.equal(actual["out"], actual["inp"])  # nnsight's assertion: the skip's value is the output
    assert_same(expected, actual, "skip after .inputs")


def test_the_rebuilt_tuple_is_still_refused_where_the_module_runs_on_it(pair):
    _, ours = pair
    h = ours.transformer.h
    with pytest.raises(InvalidWriteError, match="transformer.h.1"):
        with ours.trace(PROMPT):
            h[1].inputs = (torch.zeros_like(h[1].input),) + h[1].inputs[1:]
            h[1].output.save()
    with pytest.raises(InvalidWriteError, match="transformer.h.1"):  # skipping another module does not void it
        with ours.trace(PROMPT):
            inp = h[0].output.save()
            h[1].inputs = (torch.zeros_like(h[1].input),) + h[1].inputs[1:]
            h[2].skip(inp)


# ---- test_scan_undispatched -----------------------------------------------------------------
def scan_then_trace(model):
    with model.scan(PROMPT):
        scanned = model.transformer.h[1].output.save()
    dispatched_after_scan = model.dispatched
    with model.trace(PROMPT):
        logits = model.lm_head.output.save()
    return {"shape": tuple(scanned.shape), "after_scan": dispatched_after_scan, "logits": logits}


def test_a_checkpoint_by_name_loads_its_weights_at_the_first_trace():
    from transformers import AutoTokenizer

    import nnsight

    import nnrun
    from nnrun.assets import bundled_model_path

    path = str(bundled_model_path("tiny-facts-gpt2"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # nnsight cannot guess this folder's tokenizer class without its weights: it is handed the tokenizer
        theirs = nnsight.LanguageModel(path, tokenizer=AutoTokenizer.from_pretrained(path))
    ours = nnrun.LanguageModel(path)
    try:
        assert not theirs.dispatched and not ours.dispatched
        assert all(p.is_meta for p in ours.parameters())  # the tree is built, the weights are not loaded
        assert "GPT2Block" in str(ours) and not ours.dispatched  # printing the tree needs no weights
        expected, actual = scan_then_trace(theirs), scan_then_trace(ours)
        assert expected["after_scan"] is False and actual["after_scan"] is False
        assert ours.dispatched and not any(p.is_meta for p in ours.parameters())
        assert_same(expected, actual, "scan, then trace")
    finally:
        ours.shutdown()


def test_dispatch_true_loads_at_once_and_dispatch_is_idempotent():
    import nnrun

    ours = nnrun.LanguageModel("tiny-facts-gpt2", dispatch=True)
    try:
        engine = ours.engine
        assert ours.dispatched and not any(p.is_meta for p in ours.parameters())
        ours.dispatch()
        assert ours.engine is engine
    finally:
        ours.shutdown()


def attach_before_the_first_trace(model):
    l0 = model.transformer.h[0]
    l0.attachment = ComplexModule()
    with model.edit() as (tracer, edited_model):
        l0.output[:] = l0.attachment(l0.output, hook=True) * 2
    with edited_model.trace(PROMPT):  # the copy's trace builds the engine the original shares
        inner = l0.attachment.one.output.save()
        edited_logits = edited_model.lm_head.output.save()
    with model.trace(PROMPT):
        logits = model.lm_head.output.save()
    return {"inner": inner, "edited_logits": edited_logits, "logits": logits}


def test_modules_attached_and_edits_made_before_the_weights_load_are_kept():
    import nnsight

    import nnrun
    from nnrun.assets import bundled_model_path

    path = str(bundled_model_path("tiny-facts-gpt2"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = nnsight.LanguageModel(path, dispatch=True)  # dispatched, as nnsight's own test fixture
        expected = attach_before_the_first_trace(theirs)
    ours = nnrun.LanguageModel(path)
    try:
        actual = attach_before_the_first_trace(ours)
        assert ours.dispatched
        assert not torch.allclose(actual["edited_logits"], actual["logits"])
        assert_same(expected, actual, "attached before dispatch")
    finally:
        ours.shutdown()


def test_an_unknown_engine_option_is_refused_at_construction_without_loading():
    import nnrun

    with pytest.raises(ValueError, match="unknown engine option 'max_num_seq'"):
        nnrun.LanguageModel("tiny-facts-gpt2", max_num_seq=4)


def test_threads_that_trace_first_at_once_share_one_engine(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    import nnrun
    from interleaver.lazy_engine import EngineRecipe

    builds = []
    build = EngineRecipe.build
    monkeypatch.setattr(EngineRecipe, "build", lambda recipe, tokenizer: builds.append(1) or build(recipe, tokenizer))
    ours = nnrun.LanguageModel("tiny-facts-gpt2")

    def logits(_):
        with ours.trace(PROMPT):
            value = ours.lm_head.output.save()
        return value

    try:
        with ThreadPoolExecutor(4) as pool:
            values = list(pool.map(logits, range(4)))
        assert len(builds) == 1
        for value in values[1:]:  # the same prompt: packed with others or alone, within float rounding
            assert_same(values[0], value, "logits")
    finally:
        ours.shutdown()
