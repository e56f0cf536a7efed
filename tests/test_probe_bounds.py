"""The load-time probe's two checks: the model on the torch backend, then the configured kernels (FlashInfer here
through its emulator), and the half-precision bound that follows HF's own rounding of the model."""

from __future__ import annotations

import sys

import pytest
import torch

import nnrun
from fake_flashinfer import make_fake_flashinfer
from families.test_exact_path import RunningMeanLayer, tiny_llama
from nnrun.exact.hf_forward import HFForward
from nnrun.exact.probe import (
    Reference,
    hf_references,
    kernel_tolerance,
    packed_path_difference,
    probe_prompts,
    relative_tolerance,
)
from test_flashinfer_emulated import use_flashinfer


def reference(batch_rounding: float) -> Reference:
    return Reference(torch.zeros(1, 2), torch.zeros(2), batch_rounding)


def test_the_half_precision_bound_follows_hfs_own_batch_rounding():
    assert relative_tolerance(torch.float32, [reference(0.3)]) == 1e-3  # fp32 resolves summation order alone
    assert relative_tolerance(torch.bfloat16, [reference(0.001)]) == 2e-2
    assert relative_tolerance(torch.bfloat16, [reference(0.01), reference(0.05)]) == pytest.approx(0.15)
    assert kernel_tolerance(torch.bfloat16, [reference(0.0)]) == 6e-2
    assert kernel_tolerance(torch.bfloat16, [reference(0.05)]) == pytest.approx(0.15)
    assert kernel_tolerance(torch.float32, [reference(0.05)]) == 1e-3


def probe(llm: nnrun.LLM) -> tuple[list, list]:
    runner = llm.runner
    prompts = probe_prompts(runner.model.config.vocab_size, set(), [5, 11, 3])
    return prompts, hf_references(HFForward(runner.model, runner.device), prompts, "llama")


def test_hfs_batch_rounding_is_measured_only_in_half_precision():
    with nnrun.LLM(tiny_llama(), dtype=torch.float32) as llm:
        assert all(r.batch_rounding == 0.0 for r in probe(llm)[1])
    with nnrun.LLM(tiny_llama(), dtype=torch.bfloat16) as llm:
        _, references = probe(llm)
        # bf16 on CPU: a right-padded batch rounds like each prompt alone, within bf16's own step
        assert all(0.0 <= r.batch_rounding < 2e-2 for r in references)


def test_a_packing_error_is_still_caught_in_half_precision():
    """A layer that mixes packed requests is causal, so HF's padded batch does not move: the bound stays tight."""
    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(model.model.layers[0].mlp.act_fn, RunningMeanLayer())
    with nnrun.LLM(model, dtype=torch.bfloat16) as llm:
        assert llm.runner.exact_forward is not None
        assert "only when packed with other prompts" in llm.runner.exact_forward.reason


@pytest.fixture
def fake(monkeypatch):
    module = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def test_the_configured_kernels_are_checked_after_the_model(fake, monkeypatch):
    """Pages handed to FlashInfer in the wrong order: the torch check passes, the kernel check names the kernels."""
    import nnrun.attention.flashinfer_backend as flashinfer_backend

    with nnrun.LLM(tiny_llama(), dtype=torch.float32) as llm:
        use_flashinfer(llm)
        prompts, references = probe(llm)
        assert packed_path_difference(llm.runner, llm.runner.path, prompts, references) is None

        original = flashinfer_backend.plan_forward_batch

        def swapped_pages(forward_batch, page_size, chunk_size=None):
            plan = original(forward_batch, page_size, chunk_size)
            plan.kv_indices = plan.kv_indices.flip(0)
            return plan

        monkeypatch.setattr(flashinfer_backend, "plan_forward_batch", swapped_pages)
        reason = packed_path_difference(llm.runner, llm.runner.path, prompts, references)
        assert reason is not None and reason.endswith("on the flashinfer attention kernels"), reason
        assert llm.runner.attn_backend.name == "flashinfer"  # the probe gave the configured backend back
