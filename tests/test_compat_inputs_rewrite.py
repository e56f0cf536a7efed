"""A block that rebuilds a module's whole `.inputs` as an `(args, kwargs)` tuple, against nnsight 0.8.1 on HF.

GPT-2's blocks are called with positional values after the hidden states (HF's cache and mask;
None on nnrun's packed step). A rebuilt tuple that leaves those out is the same call where they are
None, so nnrun serves it; a rebuilt tuple that changes what every request shares is still refused.
"""

from __future__ import annotations

import pytest
import torch

from conformance.compare import assert_same
from conformance.scenarios import Padded
from interleaver.write_checks import InvalidWriteError
from test_compat_grad_source import gpt2_pair, on_both  # noqa: F401  (gpt2_pair is a fixture)

PROMPTS = ["The Eiffel Tower is in", "Paris is"]


def rebuilt_inputs(model, skip: bool):
    saved = {}
    with model.trace() as tracer:
        for index, prompt in enumerate(PROMPTS):
            with tracer.invoke(prompt):
                block = model.transformer.h[1]
                block.inputs = ((torch.zeros_like(block.input),),) + block.inputs[1:]
                if skip:
                    block.skip(block.input)
                saved[f"hidden_{index}"] = model.transformer.h[2].output.save()
                saved[f"logits_{index}"] = model.lm_head.output.save()
    lengths = [len(model.tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]  # HF pads invokes to the longest
    return {name: Padded(value, [lengths[int(name[-1])]]) for name, value in saved.items()}


@pytest.mark.parametrize("skip", [True, False], ids=["then_skip", "then_run"])
def test_rebuilt_inputs_tuple_as_nnsight_on_hf(gpt2_pair, skip):
    expected, actual = on_both(gpt2_pair, lambda model: rebuilt_inputs(model, skip))
    assert_same(expected, actual)


def test_a_rebuilt_tuple_that_changes_a_shared_value_is_still_refused(gpt2_pair):
    _, ours = gpt2_pair
    with pytest.raises(InvalidWriteError, match=r"model.transformer.h.1: cannot replace"):
        with ours.trace(PROMPTS[0]):
            block = ours.transformer.h[1]
            block.inputs = ((block.input, "not a cache"),) + block.inputs[1:]
            ours.lm_head.output.save()
