"""Every family loads in half precision with the dtypes HF's own loading gives it, whatever nnrun is given.

The oracle: the family's tiny checkpoint (saved fp32) loaded by `from_pretrained(dtype=...)`. nnrun's
loader gets the same checkpoint folder, the fp32 model in memory with `dtype=...`, and the config
with dummy weights; each of its models must hold every parameter and buffer in HF's dtype (RoPE's
`inv_freq` and what `_keep_in_fp32_modules(_strict)` names stay fp32; `model.to(dtype)` would not).
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from families.tiny import causal_lm_families, tiny_model
from nnrun.config import DeviceConfig, ModelConfig
from nnrun.loader import load_model

SAMPLE = ("llama", "qwen3", "gpt_oss", "deepseek_v3", "glm4_moe", "gemma3_text", "ernie4_5_moe")
DTYPES = (torch.bfloat16, torch.float16)


def dtypes_of(model: torch.nn.Module) -> dict[str, torch.dtype]:
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return {name: tensor.dtype for name, tensor in named if tensor is not None}


def check_family_dtypes(model_type: str) -> None:
    """Raises AssertionError naming each tensor nnrun loads in another dtype than HF; skips a family HF cannot load."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = tiny_model(model_type)
        except Exception as error:
            pytest.skip(f"HF cannot build the tiny {model_type}: {type(error).__name__}")
        user_dtypes = dtypes_of(model)
        with tempfile.TemporaryDirectory() as folder:
            try:
                model.save_pretrained(folder)
                AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            except Exception as error:
                pytest.skip(f"HF cannot save and reload the tiny {model_type}: {type(error).__name__}")
            for dtype in DTYPES:
                expected = dtypes_of(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype))
                sources = {"folder": (folder, "auto"), "in memory": (model, "auto"), "dummy": (model.config, "dummy")}
                for source_name, (source, load_format) in sources.items():
                    try:
                        loaded = load_model(ModelConfig(source, load_format=load_format), DeviceConfig(dtype=dtype))
                    except ValueError as error:  # refused by name before building (nnrun/unservable)
                        assert model_type in str(error) or "nnrun" in str(error), error
                        return
                    got = dtypes_of(loaded.model)
                    # names HF's load has and nnrun's model too (a model built from the in-memory config may lack
                    # a part the saved config adds on reload: BLT's projection); a folder load has all of them
                    names = expected.keys() if source_name == "folder" else expected.keys() & got.keys()
                    wrong = {n: (got.get(n), expected[n]) for n in names if got.get(n) != expected[n]}
                    assert not wrong, f"{model_type} ({source_name}, {dtype}): nnrun's dtype, HF's: {wrong}"
        assert dtypes_of(model) == user_dtypes, "the user's model changed dtype"


@pytest.mark.parametrize("model_type", SAMPLE)
def test_family_loads_with_hfs_dtypes(model_type):
    check_family_dtypes(model_type)


@pytest.mark.slow  # every causal LM family in transformers: a few minutes on 2 cores
@pytest.mark.parametrize("model_type", sorted(set(causal_lm_families()) - set(SAMPLE)))
def test_every_family_loads_with_hfs_dtypes(model_type):
    check_family_dtypes(model_type)
