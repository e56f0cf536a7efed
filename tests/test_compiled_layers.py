"""Decoder layers compiled inside the captured decode graphs (`compile_decoder_layers`, nnrun/compiled_layers.py).

On CPU the graphs are captured by the recording stand-in (tests/fake_cuda_graph.py) with the FlashInfer
emulator, and the layers compile with aot_eager: its graphs run aten ops, which the stand-in records
(inductor's C++ kernels would not be), so the replayed steps must equal the uncompiled engine's
bitwise. The stand-in is told to let torch.compile run under it (`ignore_compile_internals`: dynamo
otherwise falls back to eager under a dispatch mode), as a CUDA graph records compiled kernels. A
counting backend checks that the compiled graphs ran, and that one set of them serves every layer.
Inductor itself is checked on CPU against the eager layer, and on a GPU against the fp32 oracle.
"""

from __future__ import annotations

import sys
import time
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fake_cuda_graph
import nnrun
from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin
from fake_flashinfer import make_fake_flashinfer
from model_zoo import random_prompts
from nnrun.compiled_layers import CompiledLayersCapturer
from nnrun.graph_pieces import decoder_layers
from test_cuda_graphs import GRAPH_SIZES, capture_graphs, count_decode_steps, greedy_params
from test_flashinfer_emulated import make_sharp_model

PROMPTS = random_prompts([3, 5, 7], seed=4)


class CountingBackend(CompileCounterWithBackend):
    """aot_eager (or `backend`) that counts the graphs compiled and the calls of the compiled graphs."""

    def __init__(self, backend: str = "aot_eager") -> None:
        super().__init__(backend)
        self.runs = 0
        self.recorded_runs = 0  # runs while the stand-in records a capture

    def __call__(self, gm, example_inputs):
        compiled = super().__call__(gm, example_inputs)

        def run(*args):
            self.runs += 1
            self.recorded_runs += fake_cuda_graph._active_recorder is not None
            return compiled(*args)

        return run


@pytest.fixture
def counting(monkeypatch):
    """The engine's compile backend, counting; the stand-in lets compiled code run (and record) under it."""
    monkeypatch.setitem(sys.modules, "flashinfer", make_fake_flashinfer())
    monkeypatch.setattr(fake_cuda_graph._Recorder, "ignore_compile_internals", classmethod(lambda cls: True))
    backend = CountingBackend()
    monkeypatch.setattr(CompiledLayersCapturer, "backend", backend)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield backend
    torch._dynamo.reset()


def greedy_run(model, compiled: bool, **kwargs) -> tuple[list, dict, nnrun.LLM]:
    with nnrun.LLM(model, page_size=4, compile_decoder_layers=compiled, **kwargs) as llm:
        capture_graphs(llm)
        counts = count_decode_steps(llm)
        outputs = llm.generate(PROMPTS, greedy_params(5))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], counts, llm


def test_compiled_graphs_replay_the_uncompiled_tokens_and_logprobs_bitwise(counting):
    model = make_sharp_model("llama")
    expected, _, _ = greedy_run(model, compiled=False)
    assert counting.frame_count == 0
    got, counts, llm = greedy_run(model, compiled=True)
    assert counts == {"replayed": 4, "eager": 0}
    # Every layer of every recorded capture ran compiled graphs (the same number each): the graphs hold them
    num_captures = len(GRAPH_SIZES) * model.config.num_hidden_layers
    assert counting.frame_count > 0 and counting.recorded_runs > 0
    assert counting.recorded_runs % num_captures == 0
    assert got == expected
    # Eager steps run HF's own forwards again: the layers' instance `forward` is gone
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(llm.model))


@pytest.mark.slow  # two captures with compilation
def test_one_compilation_serves_every_layer(counting):
    """As many graphs compiled for 4 layers as for 1, whole-step graphs and pieces, under nnrun.LanguageModel
    (nnsight's controller on every module): no guard tells the layers apart, so no recompile per layer."""
    frames = []
    for num_layers in (1, 4):
        torch._dynamo.reset()
        before = counting.frame_count
        model = nnrun.LanguageModel(
            tiny_llama(seed=1, num_layers=num_layers),
            tokenizer=tiny_tokenizer(),
            cuda_graph_pieces=True,
            compile_decoder_layers=True,
        )
        try:
            with model.trace("hello world"):  # nnsight's controllers installed on the layers' modules
                model.model.layers[0].mlp.output.save()
            capture_graphs(model.engine)
            assert model.engine.runner.graph_pieces is not None
        finally:
            model.shutdown()
        frames.append(counting.frame_count - before)
    assert frames[0] == frames[1] > 0


def test_a_forward_hook_fires_in_the_eager_steps_after_capture(counting):
    from test_cuda_graphs import check_hooked_steps_run_eagerly_and_replay_after

    check_hooked_steps_run_eagerly_and_replay_after(compile_decoder_layers=True)


@pytest.mark.slow  # compiles whole-step graphs and pieces
def test_a_trace_with_pieces_equals_nnsight_on_hf(counting):
    """nnrun.LanguageModel, whole-step graphs and per-layer pieces compiled: a layer saved at every step
    and the tokens equal nnsight on HF's; every layer replayed its compiled piece."""
    from test_graph_pieces import NEW_TOKENS, save_layer_every_step

    model = tiny_llama(seed=4, num_layers=4)
    oracle = hf_language_model(twin(model), tiny_tokenizer())
    ours = nnrun.LanguageModel(model, tokenizer=tiny_tokenizer(), cuda_graph_pieces=True, compile_decoder_layers=True)
    try:
        ours.generate("warm up", max_new_tokens=1)  # nnsight's module wrappers are in place before the capture
        wrappers = [layer.__dict__.get("forward") for layer in decoder_layers(ours.engine.runner.model)]
        capture_graphs(ours.engine)
        assert ours.engine.runner.graph_pieces is not None
        assert [layer.__dict__.get("forward") for layer in decoder_layers(ours.engine.runner.model)] == wrappers
        runs, replayed = counting.runs, []
        gate = ours.engine.runner.watched_layers
        replayed_one = gate.replayed
        gate.replayed = lambda index: (replayed.append(index), replayed_one(index))
        hidden, ids = save_layer_every_step(ours, 2)
        assert counting.runs == runs  # eager layers run HF's forward; replays run no Python
        # every layer replayed its compiled piece: layer 2 is watched at its output only, so it replays inside
        # its handoffs (graph_pieces.py's boundary replay), and the others are not watched at all
        assert set(replayed) == {0, 1, 2, 3}
        expected_hidden, expected_ids = save_layer_every_step(oracle, 2)
    finally:
        ours.shutdown()
    assert torch.equal(ids, expected_ids)
    assert hidden.shape[0] == NEW_TOKENS
    assert torch.allclose(hidden, expected_hidden, atol=1e-5)


def _layer_inputs(model: torch.nn.Module, num_tokens: int, dtype: torch.dtype) -> tuple:
    torch.manual_seed(3)
    hidden = torch.randn(1, num_tokens, model.config.hidden_size, dtype=dtype)  # [1, T, H]
    position_ids = torch.arange(num_tokens)[None]  # [1, T]
    position_embeddings = model.model.rotary_emb(hidden, position_ids)  # ([1, T, D], [1, T, D])
    return hidden, position_ids, position_embeddings


@pytest.mark.slow  # inductor compiles C++ kernels with gcc
def test_inductor_layer_equals_the_eager_layer_within_rounding():
    """Inductor (CPU) on a tiny Llama's decoder layer: fp32 to fp32 rounding; bf16 no farther from the fp32
    layer than HF's eager bf16 layer is (fused kernels round less often, never more)."""
    reference = tiny_llama(seed=2, num_layers=1).eval()
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = twin(reference).to(dtype)
        layer = model.model.layers[0]
        hidden, position_ids, position_embeddings = _layer_inputs(model, 6, dtype)
        counter = CompileCounterWithBackend("inductor")
        capturer = CompiledLayersCapturer(_Immediate(), model.model.layers, backend=counter)

        def call() -> torch.Tensor:
            return layer(hidden, position_ids=position_ids, position_embeddings=position_embeddings)

        with torch.no_grad():
            eager = call()
            _, compiled = capturer.capture(call)
        assert counter.frame_count > 0
        assert "forward" not in layer.__dict__
        results[dtype] = eager.float(), compiled.float()
    eager32, compiled32 = results[torch.float32]
    scale = eager32.abs().max()
    assert (compiled32 - eager32).abs().max() <= 1e-5 * scale
    eager16, compiled16 = results[torch.bfloat16]
    assert (compiled16 - eager32).abs().max() <= 2 * (eager16 - eager32).abs().max()


class _Immediate:
    """A capturer that runs the function (no graph): the compiled layer's own values."""

    def capture(self, fn):
        fn()  # warm-up: compiles
        return (lambda: None), fn()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_compiled_layers_match_the_fp32_oracle_as_closely_as_uncompiled_graphs(monkeypatch):
    """The 8B shape's kernels in bf16 with inductor: each engine's logprobs against the fp32 twin; the compiled
    graphs' error stays within twice the uncompiled graphs' (bf16 rounding), and a hook still fires."""
    from test_gpu_flashinfer import TOL, assert_matches_oracle, fp32_twin, gpu_model, oracle_log_probs

    model = gpu_model("llama_hd128", torch.bfloat16)
    oracle = fp32_twin(model)
    prompts = random_prompts([5, 17, 40, 9], seed=7)
    params = nnrun.SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    counter = CompileCounterWithBackend("inductor")
    monkeypatch.setattr(CompiledLayersCapturer, "backend", counter)
    errors = {}
    for compiled in (False, True):
        kwargs = dict(device="cuda", dtype=torch.bfloat16, attention_backend="flashinfer", page_size=16)
        start = time.perf_counter()
        with nnrun.LLM(model, compile_decoder_layers=compiled, cuda_graph_batch_sizes=[1, 2, 4], **kwargs) as llm:
            print(f"compile_decoder_layers={compiled}: engine ready in {time.perf_counter() - start:.1f} s")
            assert (counter.frame_count > 0) == compiled
            counts = count_decode_steps(llm)
            outputs = llm.generate(prompts, params)
            assert counts["replayed"] > 0 and counts["eager"] == 0
            seen = []
            handle = llm.model.model.layers[0].register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
            try:
                llm.generate(prompts[:1], nnrun.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            finally:
                handle.remove()
            assert seen == [5, 1, 1]
        assert_matches_oracle(oracle, prompts, outputs, TOL[torch.bfloat16])
        diffs = []
        for prompt, output in zip(prompts, outputs):
            completion = output.outputs[0]
            expected = oracle_log_probs(oracle, prompt + completion.token_ids)  # [T, V]
            for i, token in enumerate(completion.token_ids):
                diffs.append(abs(completion.logprobs[i][token] - expected[len(prompt) - 1 + i, token].item()))
        errors[compiled] = max(diffs)
    assert errors[True] <= 2 * errors[False] + 1e-3, errors
