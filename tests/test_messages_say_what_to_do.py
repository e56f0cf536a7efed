"""The messages a newcomer meets first say what to write instead (issue 37, item 7)."""

from __future__ import annotations

import pytest

from nnsight.intervention.interleaver import OutOfOrderError

PROMPT = "the capital of france is"


@pytest.fixture(scope="module")
def model():
    import nnrun

    model = nnrun.LanguageModel("tiny-facts")
    yield model
    model.shutdown()


@pytest.mark.parametrize("read", ["output", "input", "inputs"])
def test_a_read_outside_a_trace_says_to_read_it_inside_one(model, read):
    with pytest.raises(ValueError) as caught:
        getattr(model.model.layers[1].mlp, read)
    message = str(caught.value)
    assert "inside `with model.trace(...)`" in message and "interleaving" not in message
    assert f"model.model.layers[1].mlp.{read}.save()" in message  # the working line, spelled as the user spells it


def test_an_assignment_outside_a_trace_says_so_too(model):
    with pytest.raises(ValueError, match=r"can only be set inside `with model.trace\(...\)`"):
        model.model.layers[1].output = None


def test_the_same_read_inside_a_trace_still_works(model):
    with model.trace(PROMPT):
        hidden = model.model.layers[1].mlp.output.save()
    assert hidden.shape[:2] == (1, len(model.tokenizer(PROMPT)["input_ids"]))


def test_a_misspelled_submodule_is_suggested_once(model):
    with pytest.raises(AttributeError) as caught:
        model.model.layer
    message = str(caught.value)
    assert "did you mean 'layers'?" in message and message.count("layers") == 2  # the hint, and the submodule list


@pytest.mark.parametrize(("wrong", "right"), [("outputs", "'output'"), ("inptu", "'input'")])
def test_envoy_values_are_suggested(model, wrong, right):
    with pytest.raises(AttributeError, match=f"did you mean {right}"):
        getattr(model.model.layers[1], wrong)


def test_result_before_the_loop_says_the_result_comes_after_the_last_step(model):
    def result_first():
        with model.generate(PROMPT, max_new_tokens=3) as tracer:
            result = tracer.result.save()
            for step in tracer.all():
                hidden = model.model.layers[1].output.save()
        return result, hidden

    with pytest.raises(OutOfOrderError) as caught:
        result_first()
    message = str(caught.value)
    assert "only after the model's\nlast step" in message
    assert "with tracer.invoke():" in message and "min_new_tokens=n" in message


def test_the_pattern_the_message_shows_works(model):
    with model.generate(max_new_tokens=3) as tracer:
        with tracer.invoke(PROMPT):
            hidden = list().save()
            for step in tracer.all():
                hidden.append(model.model.layers[1].output)
        with tracer.invoke():
            result = tracer.result.save()
    assert len(hidden) == 3 and result.shape[1] == len(model.tokenizer(PROMPT)["input_ids"]) + 3


def test_an_unrelated_out_of_order_read_keeps_nnsight_s_message(model):
    with pytest.raises(OutOfOrderError) as caught:
        with model.trace(PROMPT):
            model.model.layers[2].output.save()
            model.model.layers[1].output.save()
    assert "tracer.result" not in str(caught.value)
