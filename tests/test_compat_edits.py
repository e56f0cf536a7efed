"""`model.edit()` on nnrun behaves as nnsight 0.8.1's on plain HF: each case runs on both and compares.

The oracle is `nnsight.LanguageModel` over a twin of the same random model. An edit must reach
every later trace of the edited model (every prompt of every invoke), run before the trace's own
invokes, leave the original model clean (unless `inplace=True`), stack, and go with
`clear_edits()`; in generation it applies at each step it loops over.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from conformance.compare import assert_same
from conformance.models import oracle_and_nnrun, tiny_llama, tiny_tokenizer
from conformance.scenarios import Padded
from interleaver.write_checks import InvalidWriteError

P = "the cat sat on the mat"
Q = "one two"
R = "paris is the capital of france"
STEER = torch.linspace(-2.0, 2.0, 64)


class Adapter(torch.nn.Module):
    """A residual adapter attached to a layer (nnsight's `hook=True` pattern)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.inner = torch.nn.Linear(64, 64)
        with torch.no_grad():
            self.inner.weight.copy_(torch.randn(64, 64, generator=generator) * 0.1)
            self.inner.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


@pytest.fixture(scope="module")
def pair():
    oracle, ours = oracle_and_nnrun(tiny_llama(seed=5), tiny_tokenizer())
    yield oracle, ours
    ours.shutdown()


def on_both(pair, fn):
    """Run `fn(model)` on nnsight-on-HF and on nnrun (each with its own edits cleared afterwards)."""
    results = []
    for model in pair:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results.append(fn(model))
        finally:
            model.clear_edits()
    return results


def test_edited_copy_carries_the_edit_and_the_original_stays_clean(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            edited.model.layers[0].output[:] = 0
        with edited.trace(P):
            zeroed = edited.model.layers[0].output.save()
            edited_logits = edited.lm_head.output.save()
        with model.trace(P):
            clean = model.model.layers[0].output.save()
            logits = model.lm_head.output.save()
        return {"zeroed": zeroed, "edited_logits": edited_logits, "clean": clean, "logits": logits}

    expected, actual = on_both(pair, run)
    assert float(actual["zeroed"].abs().sum()) == 0.0 and float(actual["clean"].abs().sum()) > 0
    assert_same(expected, actual)


def test_inplace_edit_applies_until_clear_edits(pair):
    def run(model):
        with model.edit(inplace=True):
            model.model.layers[1].output[:, -1] += STEER
        with model.trace(P):
            steered = model.lm_head.output.save()
        model.clear_edits()
        with model.trace(P):
            cleared = model.lm_head.output.save()
        return {"steered": steered, "cleared": cleared}

    expected, actual = on_both(pair, run)
    assert not torch.allclose(actual["steered"], actual["cleared"])
    assert_same(expected, actual)


def test_edits_stack_in_the_order_they_were_made(pair):
    def run(model):
        with model.edit(inplace=True):
            model.model.layers[0].output[:] = model.model.layers[0].output * 2
        with model.edit(inplace=True):
            model.model.layers[0].output[:, 0] = 1.0  # after the first: the position stays 1
        with model.trace(P):
            hidden = model.model.layers[0].output.save()
            logits = model.lm_head.output.save()
        return {"hidden": hidden, "logits": logits}

    expected, actual = on_both(pair, run)
    assert bool((actual["hidden"][:, 0] == 1.0).all())
    assert_same(expected, actual)


def test_edit_runs_before_the_invokes_and_the_trace_sees_its_result(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            edited.model.layers[0].output[:, -1] += STEER
        with edited.trace(P):
            seen = edited.model.layers[0].output[:, -1].clone().save()  # the edited value
            edited.model.layers[0].output[:, -1] *= 0.5  # an invoke's edit lands on top of it
            logits = edited.lm_head.output.save()
        return {"seen": seen, "logits": logits}

    expected, actual = on_both(pair, run)
    assert_same(expected, actual)


def test_edit_applies_to_every_prompt_of_every_invoke(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            edited.model.layers[1].output[:, -1] = 0
        with edited.trace() as tracer:
            with tracer.invoke(P):
                a = edited.lm_head.output[:, -1].save()
            with tracer.invoke([Q, R]):
                hidden = edited.model.layers[1].output.save()
                bc = edited.lm_head.output[:, -1].save()
        return {"a": a, "bc": bc, "hidden": Padded(hidden, [2, 6])}

    expected, actual = on_both(pair, run)
    assert float(actual["hidden"].value[:, -1].abs().sum()) == 0.0
    assert_same(expected, actual)


def test_an_edits_names_stay_its_own(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            inside = edited.model.layers[0].output.save()
        with edited.trace(P):
            out = edited.lm_head.output.save()
        return "inside" in locals(), out

    (hf_bound, expected), (ours_bound, actual) = on_both(pair, run)
    assert hf_bound == ours_bound
    assert_same(expected, actual)


def test_edit_that_raises_fails_the_trace(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            hidden = edited.model.layers[0].output  # noqa: F841 (the edit parks here before it raises)
            int("not a number")
        with pytest.raises(ValueError) as raised:
            with edited.trace(P):
                edited.lm_head.output.save()
        return str(raised.value)

    expected, actual = on_both(pair, run)
    assert actual == expected


def test_edit_looping_over_generation_steps(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            for _ in tracer.iter[:]:
                edited.model.layers[1].output[:, -1] += STEER
        with edited.generate(P, max_new_tokens=4) as tracer:
            logits = list().save()
            for _ in tracer.iter[:4]:
                logits.append(edited.lm_head.output[:, -1])
            ids = tracer.result.save()
        with model.generate(P, max_new_tokens=4) as tracer:
            clean_ids = tracer.result.save()
        return {"logits": logits, "ids": ids, "clean_ids": clean_ids}

    expected, actual = on_both(pair, run)
    assert not torch.equal(actual["ids"], actual["clean_ids"])
    assert_same(expected, actual)


def test_edit_without_a_loop_applies_at_the_first_step_only(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            edited.model.layers[1].output[:, -1] += STEER * 3
        with edited.generate(P, max_new_tokens=3) as tracer:
            hidden = list().save()
            for _ in tracer.iter[:3]:
                hidden.append(edited.model.layers[1].output[:, -1])
        return hidden

    expected, actual = on_both(pair, run)
    assert_same(expected, actual)


def test_edit_in_a_multi_invoke_generation(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            for _ in tracer.iter[:]:
                edited.model.layers[0].output[:, -1] -= STEER
        with edited.generate(max_new_tokens=3) as tracer:
            with tracer.invoke(P):
                a = tracer.result.save()
            with tracer.invoke(R):
                b = tracer.result.save()
        return {"a": a[:, -3:], "b": b[:, -3:]}

    expected, actual = on_both(pair, run)
    assert_same(expected, actual)


def test_plain_generate_on_an_edited_model_applies_the_edits(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            for _ in tracer.iter[:]:
                edited.model.layers[1].output[:] = 0
        return {"edited": edited.generate(P, max_new_tokens=3), "clean": model.generate(P, max_new_tokens=3)}

    expected, actual = on_both(pair, run)
    assert not torch.equal(actual["edited"], actual["clean"])
    assert_same(expected, actual)


def test_attached_module_called_with_hook_in_an_edit(pair):
    def run(model):
        model.model.layers[0].adapter = Adapter()
        try:
            with model.edit() as (tracer, edited):
                acts = edited.model.layers[0].output
                edited.model.layers[0].output = edited.model.layers[0].adapter(acts, hook=True)
            with edited.trace(P):
                inner = edited.model.layers[0].adapter.inner.output.save()
                hidden = edited.model.layers[0].output.save()
                logits = edited.lm_head.output.save()
            with model.trace(P):
                clean = model.lm_head.output.save()
        finally:
            del model.model.layers[0]._module.adapter
        return {"inner": inner, "hidden": hidden, "logits": logits, "clean": clean}

    expected, actual = on_both(pair, run)
    assert not torch.allclose(actual["logits"], actual["clean"])
    assert_same(expected, actual)


def test_attached_module_applied_at_every_generation_step(pair):
    def run(model):
        model.model.layers[0].adapter = Adapter()
        try:
            with model.edit(inplace=True) as tracer:
                for _ in tracer.iter[:]:
                    acts = model.model.layers[0].output
                    model.model.layers[0].output = model.model.layers[0].adapter(acts, hook=True)
            with model.generate(P, max_new_tokens=3) as tracer:
                inner = list().save()
                for _ in tracer.iter[:3]:
                    inner.append(model.model.layers[0].adapter.inner.output)
                ids = tracer.result.save()
        finally:
            del model.model.layers[0]._module.adapter
        return {"inner": inner, "ids": ids}

    expected, actual = on_both(pair, run)
    assert_same(expected, actual)


def test_module_attached_inside_the_edit_block(pair):
    def run(model):
        with model.edit() as (tracer, edited):
            edited.model.layers[0].attachment = Adapter()  # replayed: attached anew by every trace
            acts = edited.model.layers[0].output
            edited.model.layers[0].output = edited.model.layers[0].attachment(acts, hook=True)
        try:
            with edited.trace(P):
                inner = edited.model.layers[0].attachment.inner.output.save()
                logits = edited.lm_head.output.save()
        finally:
            model.model.layers[0]._module.__dict__["_modules"].pop("attachment", None)
        return {"inner": inner, "logits": logits}

    expected, actual = on_both(pair, run)
    assert_same(expected, actual)


def test_each_invoke_reads_its_own_rows_of_an_attached_module_the_edit_calls(pair):
    """The edit calls the adapter once over every prompt of the trace; each invoke sees its own rows."""
    short, long = "the cat sat", "the dog ran in the park"

    def run(model):
        model.model.layers[0].adapter = Adapter()
        try:
            with model.edit() as (tracer, edited):
                layer = edited.model.layers[0]
                layer.output[:] = layer.adapter(layer.output, hook=True)
            with edited.trace() as tracer:
                with tracer.invoke(short):
                    a = edited.model.layers[0].adapter.output.save()
                    logits_a = edited.lm_head.output.save()
                with tracer.invoke(long):
                    b = edited.model.layers[0].adapter.inner.output.save()
                    logits_b = edited.lm_head.output.save()
        finally:
            del model.model.layers[0]._module.adapter
        lengths = [len(model.tokenizer(text)["input_ids"]) for text in (short, long)]
        return {
            "a": Padded(a, lengths[:1]),
            "b": Padded(b, lengths[1:]),
            "logits_a": Padded(logits_a, lengths[:1]),
            "logits_b": Padded(logits_b, lengths[1:]),
        }

    expected, actual = on_both(pair, run)
    assert actual["a"].value.shape[0] == 1 and actual["b"].value.shape[0] == 1  # one row each, not the whole trace
    assert_same(expected, actual)


def test_an_invoke_is_never_served_another_invokes_hooked_call(pair):
    """nnsight on HF hands the second invoke the first one's logit lens here; nnrun refuses by name."""
    _, ours = pair
    with pytest.raises(InvalidWriteError, match=r"model.lm_head: this call of the module was made by another invoke"):
        with ours.trace() as tracer:
            with tracer.invoke("the cat sat"):
                ours.lm_head(ours.model.layers[0].output, hook=True).save()
            with tracer.invoke("the dog ran in the park"):
                ours.lm_head.output.save()
    with ours.trace("the cat sat"):  # the engine serves on
        logits = ours.lm_head.output.save()
    assert logits.shape[:2] == (1, len(ours.tokenizer("the cat sat")["input_ids"]))
