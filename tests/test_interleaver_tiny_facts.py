"""The bundled model's patching experiment gives the same flip through nnrun as through HF hooks."""

from __future__ import annotations

import pytest
import torch

import nnrun
from test_bundled_models import (
    FINAL_INDEX,
    PARIS_PROMPT,
    ROME_PROMPT,
    SUBJECT_FIRST_INDEX,
    SUBJECT_LAST_INDEX,
    answer_token_id,
    patched_last_logits,
    tiny_facts,  # noqa: F401  (a fixture: the plain HF model and its tokenizer)
)
from tolerance import assert_close_packed

CASES = [
    (0, SUBJECT_LAST_INDEX, "Rome"),
    (1, SUBJECT_LAST_INDEX, "Rome"),
    (2, FINAL_INDEX, "Rome"),
    (0, 1, "Paris"),
    (1, SUBJECT_FIRST_INDEX, "Paris"),
    (0, FINAL_INDEX, "Paris"),
    (3, SUBJECT_LAST_INDEX, "Paris"),
]


@pytest.fixture(scope="module")
def nnrun_model():
    model = nnrun.LanguageModel("tiny-facts")
    yield model
    model.shutdown()


def nnrun_patched_last_logits(model, layer_index: int, position: int) -> torch.Tensor:
    with model.trace() as tracer:
        with tracer.invoke(ROME_PROMPT):
            source = model.model.layers[layer_index].output[:, position].clone()
        with tracer.invoke(PARIS_PROMPT):
            hidden = model.model.layers[layer_index].output
            hidden[:, position] = source
            logits = model.lm_head.output[0, -1].save()
    return logits


@pytest.mark.parametrize("layer_index, position, winner", CASES)
def test_patching_flip_equals_hf_hooks(nnrun_model, tiny_facts, layer_index, position, winner):
    hf_model, tokenizer = tiny_facts
    expected = patched_last_logits(hf_model, tokenizer, layer_index, position)
    got = nnrun_patched_last_logits(nnrun_model, layer_index, position)
    assert_close_packed(got, expected, rel=1e-4)
    assert got.argmax().item() == answer_token_id(tokenizer, f" {winner}")


def test_generate_min_new_tokens_runs_the_loop_to_its_count(nnrun_model, tiny_facts):
    """HF's min_new_tokens keeps a `tracer.all()` loop going past the model's early EOS."""
    hf_model, tokenizer = tiny_facts
    ids = tokenizer("The Eiffel Tower is in", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = hf_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    with nnrun_model.generate("The Eiffel Tower is in", max_new_tokens=8, min_new_tokens=8) as tracer:
        samples = list().save()
        for _ in tracer.all():
            samples.append(nnrun_model.samples.item())
    assert samples == expected.tolist()
