"""`compile_decoder_layers` over the zoo's families: which ones the option serves (`CHECKED_FAMILIES`).

Each family runs as tests/test_compiled_layers.py runs Llama: the recording capture stand-in with the
FlashInfer emulator, the layers compiled with aot_eager (a counting backend), so the replayed steps must equal
the uncompiled engine's bitwise; the tokens are HF's argmax and the logprobs HF's to rounding. A forward hook
on a layer then fires in every step, those steps run eagerly, and the values stay HF's. Families whose
compilation fails, or that no test here checks, are captured with HF's forwards and a warning. Inductor itself
(C++ kernels on CPU) is checked against the eager layer for a few families.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import nnrun
from conformance.models import tiny_llama
from model_zoo import VOCAB
from nnrun.compiled_layers import CHECKED_FAMILIES, CompiledLayersCapturer
from nnrun.graph_pieces import decoder_layers
from test_compiled_layers import PROMPTS, CountingBackend, _Immediate, counting  # noqa: F401 (a fixture)
from test_cuda_graphs import GRAPH_SIZES, capture_graphs, count_decode_steps, greedy_params
from test_flashinfer_emulated import make_sharp_model
from test_packed_families import hf_logits, hf_twin, tiny_model
from tolerance import assert_close_packed

NEW_TOKENS = 5
_MOE = dict(
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    vocab_size=VOCAB,
)
# zoo name -> what it adds over Llama
FAST = {
    "gemma2": "sliding and full layers, attention and final softcaps, sandwich norms",
    "gpt_neox": "parallel residual, LayerNorm, partial rotary",
    "mixtral": "sparse MoE (routing with data-dependent shapes)",
}
SLOW = {
    "qwen2": "q/k/v biases, a sliding layer",
    "qwen3": "q/k norms",
    "mistral": "sliding window",
    "gemma3": "q/k norms, RoPE bases per layer type",
    "phi3": "fused qkv and gate-up projections",
    "olmo2": "norms after attention and MLP",
    "gpt2": "Conv1D projections, learned positions, no rotary",
    "qwen2_moe": "MoE with a gated shared expert",
}


def family_model(family: str, num_layers: int | None = None) -> torch.nn.Module:
    """A tiny random-weight model of `family` (the zoo's sharp one; MoEs from their own configs)."""
    if family in ("mixtral", "qwen2_moe") or num_layers is not None:
        extra = _MOE if family in ("mixtral", "qwen2_moe") else dict(vocab_size=VOCAB)
        return tiny_model(family, **extra, **({} if num_layers is None else dict(num_hidden_layers=num_layers)))
    return make_sharp_model(family)


def greedy(llm: nnrun.LLM) -> list[tuple]:
    outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_hf_values(oracle: torch.nn.Module, got: list[tuple], family: str) -> None:
    """Tokens HF's argmax, logprobs HF's to the packed path's rounding."""
    for prompt, (tokens, logprobs) in zip(PROMPTS, got):
        expected = torch.log_softmax(hf_logits(oracle, prompt + tokens), dim=-1)  # [T, V]
        for step, token in enumerate(tokens):
            row = expected[len(prompt) - 1 + step]  # [V]
            assert token == row.argmax().item(), f"{family}: decode step {step}"
            assert_close_packed(torch.tensor(logprobs[step][token]), row[token], msg=f"{family}: step {step}")


def check_family(counting: CountingBackend, family: str) -> None:
    model = family_model(family)
    assert model.config.model_type in CHECKED_FAMILIES
    oracle = hf_twin(model)
    with nnrun.LLM(model, page_size=4) as llm:
        capture_graphs(llm)
        expected = greedy(llm)
    assert counting.frame_count == 0
    with nnrun.LLM(model, page_size=4, compile_decoder_layers=True) as llm:
        layers = decoder_layers(llm.model)
        capture_graphs(llm)
        counts = count_decode_steps(llm)
        got = greedy(llm)
        assert counts == {"replayed": NEW_TOKENS - 1, "eager": 0}
        assert counting.frame_count > 0 and counting.recorded_runs >= len(GRAPH_SIZES) * len(layers)
        assert got == expected, f"{family}: compiled graphs differ from the uncompiled ones"
        # A hook on the last layer fires in every step; those steps run HF's modules eagerly
        seen = []
        handle = layers[-1].register_forward_hook(lambda m, i, o: seen.append(1))
        try:
            hooked = greedy(llm)
        finally:
            handle.remove()
        assert len(seen) == NEW_TOKENS and counts == {"replayed": NEW_TOKENS - 1, "eager": NEW_TOKENS - 1}
        assert all("forward" not in layer.__dict__ for layer in layers)
    assert_hf_values(oracle, got, family)
    assert_hf_values(oracle, hooked, family)


@pytest.mark.parametrize("family", sorted(FAST))
def test_compiled_graphs_equal_the_uncompiled_ones_bitwise_and_hooks_fire(counting, family):
    check_family(counting, family)


@pytest.mark.slow  # one engine pair each; FAST covers the kinds of layer
@pytest.mark.parametrize("family", sorted(SLOW))
def test_more_families_compile_bitwise_and_hooks_fire(counting, family):
    check_family(counting, family)


def test_the_checked_families_are_the_tested_ones():
    """CHECKED_FAMILIES names exactly the families these tests (and test_compiled_layers.py's Llama) run."""
    tested = {family_model(family).config.model_type for family in {**FAST, **SLOW}}
    assert tested | {tiny_llama(num_layers=1).config.model_type} == CHECKED_FAMILIES


def test_an_unchecked_family_is_captured_uncompiled_with_a_warning(counting, caplog):
    model = tiny_model("granite", vocab_size=VOCAB)
    assert model.config.model_type not in CHECKED_FAMILIES
    with caplog.at_level(logging.WARNING, logger="nnrun.compiled_layers"):
        with nnrun.LLM(model, page_size=4, compile_decoder_layers=True) as llm:
            capture_graphs(llm, sizes=[1, 4])
            counts = count_decode_steps(llm)
            greedy(llm)
    assert counts == {"replayed": NEW_TOKENS - 1, "eager": 0}
    assert counting.frame_count == 0
    assert "the granite decoder layers run uncompiled" in caplog.text and "checked against HF" in caplog.text


def test_a_failed_compilation_captures_hf_forwards_with_a_warning(counting, monkeypatch, caplog):
    """A backend that raises: every capture falls back to HF's forwards, the values are the uncompiled engine's."""
    calls = []

    def failing(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(CompiledLayersCapturer, "backend", staticmethod(failing))
    model = make_sharp_model("llama")
    results = []
    with caplog.at_level(logging.WARNING, logger="nnrun.compiled_layers"):
        for compiled in (False, True):
            with nnrun.LLM(model, page_size=4, compile_decoder_layers=compiled) as llm:
                capture_graphs(llm, sizes=[1, 4])
                counts = count_decode_steps(llm)
                results.append(greedy(llm))
                assert counts == {"replayed": NEW_TOKENS - 1, "eager": 0}
                assert all("forward" not in layer.__dict__ for layer in decoder_layers(llm.model))
    assert len(calls) == 1  # compiled once, failed, never tried again
    assert results[0] == results[1]
    assert "the llama decoder layers run uncompiled" in caplog.text and "no kernels today" in caplog.text


@pytest.mark.slow  # two captures with compilation per family
@pytest.mark.parametrize("family", ["gemma2", "gpt_neox", "mixtral"])
def test_compilations_do_not_grow_with_the_layers(counting, family):
    """As many graphs compiled for 4 layers as for 2: no guard tells layers of one kind apart."""
    frames = []
    for num_layers in (2, 4):
        torch._dynamo.reset()
        before = counting.frame_count
        with nnrun.LLM(family_model(family, num_layers), page_size=4, compile_decoder_layers=True) as llm:
            capture_graphs(llm, sizes=[1, 4])
        frames.append(counting.frame_count - before)
    assert frames[0] == frames[1] > 0


def _layer_call(model: torch.nn.Module, dtype: torch.dtype):
    """One decoder layer and a call of it on 6 random tokens (no mask, no cache)."""
    torch.manual_seed(3)
    layer = decoder_layers(model)[0]
    hidden = torch.randn(1, 6, model.config.hidden_size, dtype=dtype)  # [1, T, H]
    position_ids = torch.arange(6)[None]  # [1, T]
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    position_embeddings = rotary(hidden, position_ids)  # ([1, T, D], [1, T, D])

    def call() -> torch.Tensor:
        out = layer(hidden, position_ids=position_ids, position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out

    return layer, call


@pytest.mark.slow  # inductor compiles C++ kernels with gcc
@pytest.mark.parametrize("family", ["gemma2", "gpt_neox", "mixtral"])
def test_inductor_layer_equals_the_eager_layer_within_rounding(family):
    """Inductor (CPU) on the family's first decoder layer: fp32 to fp32 rounding; bf16 no farther from the
    fp32 layer than HF's eager bf16 layer is, up to twice."""
    reference = family_model(family, num_layers=1)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = hf_twin(reference).to(dtype)
        layer, call = _layer_call(model, dtype)
        counter = CompileCounterWithBackend("inductor")
        capturer = CompiledLayersCapturer(_Immediate(), decoder_layers(model), backend=counter)
        torch._dynamo.reset()
        with torch.no_grad():
            eager = call()
            _, compiled = capturer.capture(call)
        assert counter.frame_count > 0 and capturer.failure is None
        assert "forward" not in layer.__dict__
        results[dtype] = eager.float(), compiled.float()
    eager32, compiled32 = results[torch.float32]
    assert (compiled32 - eager32).abs().max() <= 1e-5 * eager32.abs().max()
    eager16, compiled16 = results[torch.bfloat16]
    assert (compiled16 - eager32).abs().max() <= 2 * (eager16 - eager32).abs().max()
