"""nnrun.VLLM: code written for nnsight's VLLM class runs unchanged on nnrun.

Oracles: nnsight on the plain HF model for activation values (fp32, 1e-5), nnrun.LLM.generate
with the equivalent SamplingParams for sampling semantics, hand-computed expectations (greedy is
the argmax of the saved logits), and the shapes vLLM's sampler gives (`[1, V]` logits, `[1, 1]`
samples). The docs examples at the end are nnsight's VLLM docs, with only the import, the model
and the layer index changed (the bundled GPT-2 has 4 layers).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin
from interleaver.vllm_params import vllm_engine_kwargs, vllm_sampling_params
from nnrun import RequestOutput, SamplingParams
from tolerance import assert_close_packed

P1 = "the eiffel tower is in the city of"
P2 = "big ben is in"


@pytest.fixture(scope="module")
def models():
    from nnrun import VLLM

    tokenizer = tiny_tokenizer()
    model = tiny_llama(seed=7)
    oracle = hf_language_model(twin(model), tokenizer)
    ours = VLLM(
        model,
        tokenizer=tokenizer,
        device="cpu",
        dispatch=True,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=1,
        enforce_eager=True,
        max_model_len=128,
        block_size=8,
        seed=1234,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield oracle, ours
    ours.shutdown()


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close_packed(actual, expected, msg="against nnsight's VLLM spelling on HF")


# ---- constructor ----------------------------------------------------------------------------
def test_vllm_engine_keywords_reach_the_engine(models):
    _, ours = models
    config = ours.engine.config
    assert (config.model.max_model_len, config.cache.page_size, config.cache.gpu_memory_utilization) == (128, 8, 0.5)
    assert config.device.enable_cuda_graphs is False  # enforce_eager=True
    assert torch.initial_seed() == 1234  # seed= seeds the RNG unseeded requests draw from, as vLLM's worker
    assert ours.vllm_entrypoint is ours.engine and ours.dispatched


@pytest.mark.parametrize(
    "keyword",
    [  # (tensor_parallel_size is served: tests/tp/test_tp_nnsight.py)
        {"pipeline_parallel_size": 2},
        {"distributed_executor_backend": "ray"},
        {"mode": "async"},
        {"quantization": "awq"},
    ],
)
def test_engine_options_nnrun_cannot_honour_are_refused_by_name(keyword):
    from nnrun import VLLM

    ((name, value),) = keyword.items()
    with pytest.raises(NotImplementedError, match=f"{name}={value!r}"):
        VLLM("tiny-facts", **keyword)


def test_engine_keyword_translation():
    kwargs, seed = vllm_engine_kwargs(
        {
            "dtype": "float32",
            "max_num_seqs": 4,
            "max_num_batched_tokens": 64,
            "block_size": 32,
            "enforce_eager": False,
            "seed": 3,
            "dispatch": True,
            "distributed_executor_backend": "uni",
            "max_total_tokens": 256,
        }
    )
    assert kwargs == {
        "dtype": "float32",
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "page_size": 32,
        "enable_cuda_graphs": True,
        "max_total_tokens": 256,
    }  # nnrun's own options pass through
    assert seed == 3 and "dispatch" not in kwargs and "seed" not in kwargs


# ---- activations: HF's values and shapes ----------------------------------------------------
def test_activations_equal_nnsight_on_hf(models):
    oracle, ours = models
    with oracle.trace(P1):
        hidden = oracle.model.layers[1].output.save()
        mlp = oracle.model.layers[2].mlp.output.save()
        last = oracle.lm_head.output[:, -1].save()
    with ours.trace(P1):  # vLLM's defaults: 16 tokens at temperature 1; the prefill is what is read
        ours_hidden = ours.model.layers[1].output.save()
        ours_mlp = ours.model.layers[2].mlp.output.save()
        ours_logits = ours.logits.save()
    close(ours_hidden, hidden)  # [1, T, H]: HF's shape, not vLLM's flat [T, H]
    close(ours_mlp, mlp)
    close(ours_logits, last)


def test_tracer_cache_equals_nnsight_on_hf(models):
    oracle, ours = models
    with oracle.trace(P1) as tracer:
        expected = tracer.cache(modules=[oracle.model.layers[0]])
    with ours.trace(P1, temperature=0.0, max_tokens=1) as tracer:
        actual = tracer.cache(modules=[ours.model.layers[0]])
    close(actual["model.model.layers.0"].output, expected["model.model.layers.0"].output)


def test_prompt_forms_give_the_same_activations(models):
    _, ours = models
    ids = ours.tokenizer(P2)["input_ids"]
    padded = ours.tokenizer([P2], padding="max_length", max_length=len(ids) + 3, return_tensors="pt")
    forms = [P2, ids, dict(padded), {"prompt_token_ids": ids}, {"prompt": P2}]
    with ours.trace(temperature=0.0, max_tokens=1) as tracer:
        hidden = list().save()
        for form in forms:
            with tracer.invoke(form):
                hidden.append(ours.model.layers[0].output)
    for value in hidden[1:]:
        close(value, hidden[0])
    assert hidden[0].shape[1] == len(ids)  # the attention mask dropped the padding


def test_step_shapes_are_vllms(models):
    _, ours = models
    with ours.trace(temperature=0.0, max_tokens=2) as tracer:
        with tracer.invoke(P1):
            logits, samples = ours.logits.save(), ours.samples.save()
            tracer.next()
            decode_hidden = ours.model.layers[0].output.save()
        with tracer.invoke([P1, P2]):  # several prompts per invoke: nnrun's extension
            many_logits, many_samples = ours.logits.save(), ours.samples.save()
            results = tracer.result.save()
    vocab = ours.engine.vocab_size
    assert logits.shape == (1, vocab) and samples.shape == (1, 1) and samples.dtype == torch.int64
    assert decode_hidden.shape == (1, 1, 64)  # a decode step is one token
    assert many_logits.shape == (2, vocab) and many_samples.shape == (2, 1)
    assert [r.prompt for r in results] == [P1, P2]


# ---- sampling: vLLM's meaning of each keyword -----------------------------------------------
def test_greedy_samples_are_the_argmax_of_the_logits_hf_computes(models):
    oracle, ours = models
    with oracle.generate(P1, max_new_tokens=3) as tracer:
        expected = list().save()
        for _ in tracer.iter[:3]:
            expected.append(oracle.lm_head.output[:, -1])
    with ours.trace(P1, temperature=0.0, top_p=1.0, max_tokens=3) as tracer:
        logits, samples = list().save(), list().save()
        for _ in tracer.iter[:3]:
            logits.append(ours.logits)
            samples.append(ours.samples)
        result = tracer.result.save()
    assert len(samples) == 3 and result.outputs[0].token_ids == [s.item() for s in samples]
    for step in range(3):
        close(logits[step], expected[step])
        assert samples[step].item() == logits[step].argmax().item()


def test_defaults_are_vllms_sixteen_tokens(models):
    _, ours = models
    with ours.trace(P2) as tracer:
        result = tracer.result.save()
    assert isinstance(result, RequestOutput) and len(result.outputs[0].token_ids) == 16


def test_per_invoke_sampling_is_applied_per_invoke(models):
    _, ours = models
    with ours.trace(max_tokens=6) as tracer:  # the trace's keywords fill in what an invoke leaves unset
        with tracer.invoke(P1, temperature=0.0):
            greedy = tracer.result.save()
        with tracer.invoke(P2, temperature=0.8, top_p=0.95, seed=3):
            sampled = tracer.result.save()
        with tracer.invoke(P2, temperature=0.0, max_new_tokens=2):
            short = tracer.result.save()
    expected = ours.engine.generate(
        [P1, P2, P2, P2],
        [
            SamplingParams(max_tokens=6, temperature=0.0),
            SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, seed=3),
            SamplingParams(max_tokens=2, temperature=0.0),
            SamplingParams(max_tokens=6, temperature=0.0),
        ],
    )
    actual = [greedy, sampled, short]
    assert [a.outputs[0].token_ids for a in actual] == [e.outputs[0].token_ids for e in expected[:3]]
    assert sampled.outputs[0].token_ids != expected[3].outputs[0].token_ids  # it sampled: not the greedy tokens


def test_every_sampling_keyword_means_what_vllm_means(models):
    _, ours = models
    settings = dict(
        max_tokens=6,
        min_tokens=2,
        temperature=0.9,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=5,
        stop=[" city"],
        stop_token_ids=[3],
        presence_penalty=0.5,
        frequency_penalty=0.2,
        repetition_penalty=1.3,
        logprobs=2,
        skip_special_tokens=True,
        ignore_eos=False,
    )
    with ours.trace(P1, **settings) as tracer:
        result = tracer.result.save()
    expected = ours.engine.generate([P1], SamplingParams(**settings))[0]
    assert result.outputs == expected.outputs
    assert vllm_sampling_params({"temperature": 1e-6}).is_greedy  # vLLM: below its epsilon is greedy
    assert vllm_sampling_params({"top_k": -1, "max_new_tokens": 4}) == SamplingParams(top_k=0, max_tokens=4)


def test_generate_is_trace_and_plainly_returns_request_outputs(models):
    _, ours = models
    with ours.generate(P1, max_new_tokens=2, temperature=0.0) as tracer:
        result = tracer.result.save()
    outputs = ours.generate([P1, P2], max_tokens=2, temperature=0.0)
    expected = ours.engine.generate([P1, P2], SamplingParams(max_tokens=2, temperature=0.0))
    assert [o.outputs for o in outputs] == [e.outputs for e in expected]
    assert result.outputs == expected[0].outputs and result.prompt == P1 and result.finished
    assert "nnsight" not in result.extra_args  # a saved result does not keep the trace alive


def test_assigning_samples_forces_tokens(models):
    _, ours = models
    with ours.trace(P1, temperature=0.0, max_tokens=3) as tracer:
        for step in tracer.iter[:3]:
            if step < 2:
                ours.samples = torch.zeros_like(ours.samples)  # [1, 1], as vLLM's
            else:
                ours.samples[:] = 7  # in place
        result = tracer.result.save()
    assert result.outputs[0].token_ids == [0, 0, 7]


@pytest.mark.parametrize(
    "keywords, error, name",
    [
        ({"temperatur": 0.0}, TypeError, "temperatur"),
        ({"n": 2}, NotImplementedError, "n=2"),
        ({"logit_bias": {3: 1.0}}, NotImplementedError, "logit_bias"),
        ({"serve": "http://localhost:8000"}, NotImplementedError, "serve"),
        ({"max_tokens": 2, "max_new_tokens": 2}, TypeError, "max_new_tokens"),
    ],
)
def test_keywords_nnrun_cannot_honour_are_refused_by_name(models, keywords, error, name):
    _, ours = models
    with pytest.raises(error, match=name):
        with ours.trace(P1, **keywords):
            pass
    with pytest.raises(error, match=name):
        with ours.trace() as tracer:
            with tracer.invoke(P1, **keywords):
                pass
    with pytest.raises(error, match=name):
        ours.generate(P1, **keywords)


def test_nnrun_extensions_work_on_vllm(models):
    _, ours = models
    with ours.trace(P1, temperature=0.0, max_tokens=1, output_attentions=True):
        pattern = ours.model.layers[0].self_attn.output[1].save()
    assert pattern.shape == (1, 4, 8, 8)  # [1, heads, T, T]: attention probabilities nnsight's VLLM cannot give
    plain = ours.generate([P1, P2], max_tokens=3, temperature=0.0)
    with ours.edit(inplace=True):
        ours.model.layers[0].output[:] = 0
    try:
        edited = ours.generate([P1, P2], max_tokens=3, temperature=0.0)  # stored edits run on plain generate too
        with ours.trace(P1, temperature=0.0, max_tokens=3) as tracer:
            traced = tracer.result.save()
    finally:
        ours.clear_edits()
    assert edited[0].outputs[0].token_ids == traced.outputs[0].token_ids != plain[0].outputs[0].token_ids
    assert [o.prompt for o in edited] == [P1, P2]


# ---- nnsight's VLLM docs, run unchanged on the bundled GPT-2 --------------------------------
@pytest.fixture(scope="module")
def gpt2():
    from nnrun import VLLM

    model = VLLM("tiny-facts-gpt2", gpu_memory_utilization=0.1, dispatch=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield model
    model.shutdown()


def test_docs_single_prompt(gpt2):
    model = gpt2
    with model.trace("The Eiffel Tower is in", temperature=0.0, top_p=1):
        logits = model.logits.save()
    assert model.tokenizer.decode(logits.argmax(dim=-1)) == " Paris"
    with model.trace("The Eiffel Tower is in", temperature=0.0):
        model.transformer.h[2].output[:] = 0
        edited = model.logits.save()
    assert not torch.allclose(edited, logits)


def test_docs_multi_token_generation_and_result(gpt2):
    model = gpt2
    with model.trace("The capital of Japan is", temperature=0.0, top_p=1.0, max_tokens=3) as tracer:
        logits = list().save()
        for _ in tracer.iter[0:3]:
            logits.append(model.logits)
    assert model.tokenizer.batch_decode([step.argmax(dim=-1) for step in logits])[:2] == [" Tokyo", "."]
    with model.trace("The Eiffel Tower is in", temperature=0.0, max_tokens=3) as tracer:
        hidden = model.transformer.h[2].output.save()
        result = tracer.result.save()
    assert result.outputs[0].text == " Paris." and hidden.shape == (1, len(result.prompt_token_ids), 192)


@pytest.mark.filterwarnings("ignore:.*was never reached")  # the docs end with open `tracer.all()` loops
def test_docs_continuous_batching(gpt2):
    model = gpt2
    with model.trace(max_tokens=3, temperature=0.0) as tracer:
        with tracer.invoke("The Eiffel Tower is in"):
            paris = list().save()
            for _ in tracer.all():
                paris.append(model.samples.item())
        with tracer.invoke("The capital of Japan is"):
            tokyo = list().save()
            for _ in tracer.all():
                tokyo.append(model.samples.item())
    assert model.tokenizer.decode(paris).startswith(" Paris")
    assert model.tokenizer.decode(tokyo).startswith(" Tokyo")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_vllm_runs_on_the_gpu_by_default():
    from nnrun import VLLM

    model = VLLM("tiny-facts-gpt2", gpu_memory_utilization=0.1, dispatch=True)
    try:
        with model.trace("The Eiffel Tower is in", temperature=0.0, top_p=1):
            logits = model.logits.save()
        assert logits.device.type == "cuda"
        assert model.tokenizer.decode(logits.argmax(dim=-1)) == " Paris"
    finally:
        model.shutdown()
