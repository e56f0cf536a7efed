"""The load-time probe's checks of dtypes and high positions, and what nnrun does with an in-memory model's dtype."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nnrun
from families.test_exact_path import tiny_llama
from families.tiny import tiny_model
from nnrun.exact import ModelRefusedError
from nnrun.hf_dtypes import cast_like_hf
from nnrun.model_runner import ModelRunner


def long_llama() -> LlamaForCausalLM:
    """A tiny Llama whose positions reach 4096: the probe's high-position prompt ends near position 4095."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval()


def test_a_model_cast_wholesale_is_refused_at_load_naming_its_rounded_tensors():
    model = tiny_llama().to(torch.bfloat16)  # RoPE's inv_freq rounded to bf16, as HF's loading never leaves it
    for dtype in (None, torch.bfloat16):  # kept as given either way: the probe names it
        with pytest.raises(ModelRefusedError) as refused:
            nnrun.LLM(model, dtype=dtype)
        message = str(refused.value)
        assert (
            message.startswith("llama: ")
            and "model.rotary_emb.inv_freq: bfloat16, HF's loading gives float32" in message
        )
        assert "from_pretrained(..., dtype=torch.bfloat16)" in message


def test_a_router_bias_hf_keeps_in_fp32_is_checked_too():
    model = cast_like_hf(tiny_model("glm4_moe"), torch.bfloat16)
    bias = next(name for name, _ in model.named_buffers() if name.endswith("e_score_correction_bias"))
    assert model.get_buffer(bias).dtype == torch.float32  # `_keep_in_fp32_modules_strict`
    model.get_buffer(bias).data = model.get_buffer(bias).data.bfloat16()
    with pytest.raises(ModelRefusedError, match=f"{bias}: bfloat16, HF's loading gives float32"):
        nnrun.LLM(model)


def test_an_in_memory_model_keeps_its_dtypes_or_is_served_as_an_hf_cast_copy():
    model = tiny_llama()
    with nnrun.LLM(model) as llm:  # no dtype: the user's object itself
        assert llm.model is model
    with nnrun.LLM(model, dtype=torch.bfloat16) as llm:  # another dtype: a copy, cast as HF's loading would
        assert llm.model is not model and llm.model.model.embed_tokens.weight.dtype == torch.bfloat16
        assert llm.model.model.rotary_emb.inv_freq.dtype == torch.float32
        assert torch.equal(llm.model.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert {t.dtype for t in model.state_dict().values()} == {torch.float32}  # the user's model is unchanged
    half = cast_like_hf(model, torch.bfloat16)
    with nnrun.LLM(half, dtype=torch.bfloat16) as llm:  # already in that dtype: kept
        assert llm.model is half


def test_dummy_weights_get_hfs_keep_in_fp32_plan():
    config = tiny_model("ernie4_5_moe").config
    with nnrun.LLM(config, load_format="dummy", dtype=torch.bfloat16) as llm:
        gates = {t.dtype for name, t in llm.model.named_parameters() if name.endswith("gate.weight")}
        assert gates == {torch.float32}  # `_keep_in_fp32_modules_strict = ["gate.weight", ...]`
        assert llm.model.model.embed_tokens.weight.dtype == torch.bfloat16


def bf16_positions(packed_step):
    """A packed step whose position ids went through bf16: exact up to 256, off by up to 8 near 4096."""

    def step(self, forward_batch, path=None):
        rounded = forward_batch.positions.to(torch.bfloat16).to(torch.int64)
        return packed_step(self, type(forward_batch)(**{**vars(forward_batch), "positions": rounded}), path)

    return step


def test_the_probe_checks_high_positions(monkeypatch):
    with nnrun.LLM(long_llama()) as llm:
        assert llm.runner.exact_forward is None  # HF's numbers at positions up to 4095 too
    monkeypatch.setattr(ModelRunner, "packed_step", bf16_positions(ModelRunner.packed_step))
    with nnrun.LLM(long_llama()) as llm:
        reason = llm.runner.exact_forward.reason
    assert "8-token prompt at positions 4087.." in reason, reason


def test_the_high_positions_stop_at_max_model_len(monkeypatch):
    """With max_model_len 256 the high-position prompt stays below 256, where bf16 positions are exact."""
    monkeypatch.setattr(ModelRunner, "packed_step", bf16_positions(ModelRunner.packed_step))
    with nnrun.LLM(long_llama(), max_model_len=256) as llm:
        assert llm.runner.exact_forward is None
