"""Families nnrun refuses at load by what their class is (nnrun/unservable.py): by name, before building them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import nnrun
from families.tiny import tiny_config, tiny_model
from nnrun.exact import ModelRefusedError


def test_a_drafter_checkpoint_is_refused_by_name_before_its_weights_are_read(tmp_path):
    # A folder with config.json alone: building the model would fail on the missing weights, so
    # the refusal proves nnrun decided from the config, before reading any weights.
    tiny_config("gemma4_assistant").save_pretrained(tmp_path)
    with pytest.raises(ModelRefusedError, match=r"^gemma4_assistant: Gemma4AssistantForCausalLM is a drafter") as error:
        nnrun.LLM(str(tmp_path))
    assert "shared_kv_states" in str(error.value) and "serve the target model" in str(error.value)


def test_an_audio_codebook_model_is_refused_by_name():
    model = tiny_model("musicgen")
    with pytest.raises(RuntimeError):  # HF's own forward cannot take one row of token ids: it reads 4 per sequence
        model(input_ids=torch.tensor([[17, 33, 45]]))
    with pytest.raises(
        ModelRefusedError,
        match=r"^musicgen_decoder: MusicgenForCausalLM generates audio, not text \(it reads and predicts 4 parallel "
        r"codebooks",
    ):
        nnrun.LLM(model)


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed: gemma3n builds")
def test_a_model_needing_a_library_that_is_not_installed_is_refused_naming_it():
    with pytest.raises(
        ModelRefusedError,
        match=r"^gemma3n: building Gemma3nForConditionalGeneration needs a library that is not installed "
        r"\(TimmWrapperModel requires the timm library",
    ):
        nnrun.LLM(tiny_config("gemma3n"), load_format="dummy")
