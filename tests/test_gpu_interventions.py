"""nnsight interventions on a CUDA engine (skipped without CUDA).

1. Every conformance scenario on the GPU in float32 (the torch attention backend, FlashInfer has no
   float32 kernels), against nnsight on the same HF model on the same GPU, at the CPU suite's 1e-4.
   Scenarios whose own code builds CPU tensors fail on nnsight too; those are skipped, not counted.
2. A patching trace and a steered generation in bfloat16 on FlashInfer with decode CUDA graphs
   captured (traced steps must run eagerly), against nnsight on the same bfloat16 HF model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from conformance.compare import assert_same
from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer
from conformance.scenarios import SCENARIOS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def fp32_models():
    import nnrun

    tokenizer = tiny_tokenizer()
    model = tiny_llama().to("cuda")
    oracle = hf_language_model(copy.deepcopy(model), tokenizer)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer, device="cuda", dtype=torch.float32)
    assert ours.engine.runner.attn_backend.name == "torch"
    yield oracle, ours, tokenizer
    ours.shutdown()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_on_cuda_matches_nnsight_on_hf(fp32_models, name):
    oracle, ours, tokenizer = fp32_models
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            expected = SCENARIOS[name](oracle, tokenizer)
        except RuntimeError as error:
            if "device" in str(error):
                pytest.skip(f"the scenario's own tensors are on the CPU: {error}")
            raise
        actual = SCENARIOS[name](ours, tokenizer)
    assert_same(expected, actual, name)


@pytest.fixture(scope="module")
def bf16_models():
    import nnrun
    from test_gpu_flashinfer import gpu_model

    tokenizer = tiny_tokenizer()
    model = gpu_model("llama", torch.bfloat16).to("cuda")  # head dim 64, hidden 256
    oracle = hf_language_model(copy.deepcopy(model), tokenizer)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer, device="cuda", dtype=torch.bfloat16)
    runner = ours.engine.runner
    assert runner.attn_backend.name == "flashinfer" and runner.graph_runner is not None
    yield oracle, ours
    ours.shutdown()


PROMPT_A, PROMPT_B = "the eiffel tower is in the city of", "the colosseum is in the city of"


def _patching(model):
    # Positions counted from the end: the prompts differ in length, and nnsight on HF left-pads the
    # shorter one (its `[:, 2]` is another token than in the prompt's own `[1, T, H]`, which nnrun serves).
    with model.trace() as tracer:
        with tracer.invoke(PROMPT_B):
            source = model.model.layers[0].output[:, -3].clone()
        with tracer.invoke(PROMPT_A):
            hidden = model.model.layers[0].output
            hidden[:, -3] = source
            layer = model.model.layers[1].output[0].save()  # modules in the order they run
            patched = model.lm_head.output[0, -1].save()
    return patched, layer


def _steered_generation(model):
    vector = torch.linspace(-1.0, 1.0, 256, device="cuda", dtype=torch.bfloat16)
    with model.generate(PROMPT_A, max_new_tokens=4) as tracer:
        logits = list().save()
        for step in tracer.iter[:4]:
            model.model.layers[1].output[:] += vector
            logits.append(model.lm_head.output[0, -1])
        ids = tracer.result.save()
    return ids, torch.stack(list(logits))


def test_bf16_patching_on_flashinfer_matches_nnsight(bf16_models):
    oracle, ours = bf16_models
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (want_logits, want_layer), (got_logits, got_layer) = _patching(oracle), _patching(ours)
    # bf16 activations: both sides round differently (sdpa vs FlashInfer); compare log-probabilities
    torch.testing.assert_close(
        got_logits.float().log_softmax(-1), want_logits.float().log_softmax(-1), atol=3e-2, rtol=0
    )
    torch.testing.assert_close(
        got_layer[-got_layer.shape[0] :].float(), want_layer[-got_layer.shape[0] :].float(), atol=5e-2, rtol=2e-2
    )


def test_bf16_steered_generation_runs_eagerly_and_matches_nnsight(bf16_models):
    oracle, ours = bf16_models
    runner = ours.engine.runner
    replays = {"count": 0}
    replay = runner.graph_runner.replay
    runner.graph_runner.replay = lambda batch: (replays.__setitem__("count", replays["count"] + 1), replay(batch))[1]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want_ids, want_logits = _steered_generation(oracle)
            got_ids, got_logits = _steered_generation(ours)
    finally:
        runner.graph_runner.replay = replay
    assert replays["count"] == 0, "a traced decode step replayed a graph and skipped the steering"
    assert got_ids.tolist()[0][-4:] == want_ids.tolist()[0][-4:]
    torch.testing.assert_close(
        got_logits.float().log_softmax(-1), want_logits.float().log_softmax(-1), atol=3e-2, rtol=0
    )


def test_bf16_patching_error_against_an_fp32_oracle_is_hf_bf16s_own(bf16_models):
    """Both bf16 sides against nnsight on the same weights in float32: nnrun's error is of HF bf16's order.

    The bf16 comparison above cannot tell rounding from a bug (sdpa and FlashInfer round differently);
    the float32 oracle can: a wrong value would sit far outside what HF's own bf16 run is off by.
    """
    from conformance.models import tiny_tokenizer

    oracle, ours = bf16_models
    fp32 = hf_language_model(copy.deepcopy(oracle._module).float(), tiny_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (exact_logits, exact_layer), (hf_logits, hf_layer), (got_logits, got_layer) = (
            _patching(fp32),
            _patching(oracle),
            _patching(ours),
        )
    rows = got_layer.shape[0]

    def error(value, exact):
        return ((value.float() - exact.float()).abs().max() / exact.float().abs().max()).item()

    hf_error, our_error = error(hf_layer[-rows:], exact_layer[-rows:]), error(got_layer[-rows:], exact_layer[-rows:])
    hf_logit_error, our_logit_error = error(hf_logits, exact_logits), error(got_logits, exact_logits)
    print(
        f"layer-1 error vs fp32: HF bf16 {hf_error:.4f}, nnrun bf16 {our_error:.4f}; "
        f"logits: HF bf16 {hf_logit_error:.4f}, nnrun bf16 {our_logit_error:.4f}"
    )
    assert our_error <= 2 * hf_error + 4e-3
    assert our_logit_error <= 2 * hf_logit_error + 4e-3
