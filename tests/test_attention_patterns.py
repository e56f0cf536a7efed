"""`output_attentions=True`: each attention module's second output is HF eager's probabilities.

Oracles: plain HF with eager attention (`output_attentions=True`) for every family, in prefill and
in each generation step over the cached keys; nnsight on an eager HF model for left-padded
multi-prompt invokes, saving and editing. Requests that do not ask keep the fast path bitwise.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import nnrun
from conformance.compare import assert_same
from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin
from fake_cuda_graph import RecordingCapturer
from fake_flashinfer import make_fake_flashinfer
from model_zoo import FAMILIES, make_twin, random_prompts
from nnrun.attention.probabilities import AttentionProbs
from nnrun.forward_batch import OUTPUT_ATTENTIONS_ARG, ForwardMode
from test_flashinfer_emulated import make_sharp_model, use_flashinfer

TOL = 1e-5
PROMPT_LEN = 40  # longer than every zoo window (16, 24), so windows bind in prefill and decode
NUM_NEW = 3
WORDS = "the eiffel tower is in the city of"


def attention_paths(model: torch.nn.Module) -> list[str]:
    """HF module paths of the attention modules, in layer order."""
    paths = [name for name, module in model.named_modules() if type(module).__name__.endswith("Attention")]
    assert len(paths) == model.config.num_hidden_layers, paths
    return paths


def envoy_at(envoy, path: str):
    for part in path.split("."):
        envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
    return envoy


def sharp_pair(family: str):
    """A zoo model whose attention is sharp enough that softcaps, windows and masks bind at 1e-5."""
    model = make_sharp_model(family)
    with torch.no_grad():  # GPT-2, GPT-NeoX and Phi3 fuse q, k, v: sharpen the whole projection
        for name, param in model.named_parameters():
            if name.endswith(("attn.c_attn.weight", "attention.query_key_value.weight", "self_attn.qkv_proj.weight")):
                param.mul_(3.0)
    return model, make_twin(model)


@torch.no_grad()
def hf_generate_attentions(oracle, prompt: list[int], num_new: int):
    """HF eager generation: the tokens, and per step a tuple of per-layer `[1, H, q, kv]` probabilities."""
    out = oracle.generate(
        torch.tensor([prompt]),
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        do_sample=False,
        output_attentions=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), out.attentions


# ---- every family, against plain HF eager -----------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_probabilities_equal_hf_eager(family):
    model, oracle = sharp_pair(family)
    prompt = random_prompts([PROMPT_LEN], seed=4)[0]
    paths = attention_paths(model)
    with torch.no_grad():
        expected = oracle(torch.tensor([prompt]), output_attentions=True).attentions
    lm = nnrun.LanguageModel(model)
    try:
        with lm.trace(prompt, output_attentions=True):
            got = list().save()
            for path in paths:
                got.append(envoy_at(lm, path).output[1])
    finally:
        lm.shutdown()
    for layer, (want, have) in enumerate(zip(expected, got)):
        assert have.shape == want.shape, (family, layer)
        torch.testing.assert_close(have, want, atol=TOL, rtol=0, msg=lambda m: f"{family} layer {layer}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_step_probabilities_equal_hf_eager_over_the_cache(family):
    """Each step `[1, H, 1, T_kv]`; on sliding layers the keys HF's sliding cache keeps (the window)."""
    model, oracle = sharp_pair(family)
    prompt = random_prompts([PROMPT_LEN], seed=5)[0]
    paths = attention_paths(model)
    tokens, expected = hf_generate_attentions(oracle, prompt, NUM_NEW)
    lm = nnrun.LanguageModel(model)
    try:
        with lm.generate(prompt, max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, output_attentions=True) as tracer:
            steps = list().save()
            for _ in tracer.iter[:NUM_NEW]:
                steps.append([envoy_at(lm, path).output[1] for path in paths])
            ids = tracer.result.save()
    finally:
        lm.shutdown()
    assert ids[0, len(prompt) :].tolist() == tokens, family
    assert len(steps) == len(expected) == NUM_NEW
    for step, (want_layers, have_layers) in enumerate(zip(expected, steps)):
        for layer, (want, have) in enumerate(zip(want_layers, have_layers)):
            assert have.shape == want.shape, (family, step, layer, tuple(have.shape), tuple(want.shape))
            torch.testing.assert_close(
                have, want, atol=TOL, rtol=0, msg=lambda m: f"{family} step {step} layer {layer}: {m}"
            )


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gpt2", "phi3"])
def test_engine_steps_mixing_prefills_and_decodes(family):
    """Engine level: decodes share steps with new prefills (page size 4); asking requests get HF's rows,
    and the requests that do not ask come out bitwise as when nobody asks."""
    model, oracle = sharp_pair(family)
    prompts = random_prompts([5, 40, 2, 30, 17], seed=3)
    asks = [True, False, True, True, False]
    params = nnrun.SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)
    runs = {}
    for label, flags in (("asking", asks), ("none", [False] * len(asks))):
        with nnrun.LLM(model, page_size=4, max_num_batched_tokens=48) as llm:
            recorded = record_probabilities(llm)
            with llm.paused():  # every request waits before the first step: the same steps in both runs
                handles = [
                    llm.submit(p, params, extra_args={OUTPUT_ATTENTIONS_ARG: True} if flag else None)
                    for p, flag in zip(prompts, flags)
                ]
            outputs = [handle.result() for handle in handles]
            windows = [layer.sliding_window for layer in llm.runner.layers]
            recorded.pop("remove_hooks")()
        runs[label] = (outputs, recorded, windows)
    outputs, recorded, windows = runs["asking"]
    assert any(mode is ForwardMode.EXTEND and num_decoding for mode, num_decoding, _ in recorded["steps"]), (
        "the workload must mix decodes into prefill steps"
    )
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        quiet = runs["none"][0][i].outputs[0]
        if not asks[i]:
            assert output.outputs[0].token_ids == quiet.token_ids
            assert output.outputs[0].logprobs == quiet.logprobs  # bitwise: floats compared exactly
            assert output.request_id not in recorded["by_request"]
            continue
        sequence = prompt + output.outputs[0].token_ids
        with torch.no_grad():
            full = oracle(torch.tensor([sequence]), output_attentions=True).attentions  # per layer [1, H, S, S]
        per_layer = recorded["by_request"][output.request_id]
        for layer, served in per_layer.items():
            window = windows[layer]
            assert len(served) == len(output.outputs[0].token_ids)  # the prefill, then a decode per new token
            prefill = served[0]
            torch.testing.assert_close(prefill[0], full[layer][0, :, : len(prompt), : len(prompt)], atol=TOL, rtol=0)
            for step, probs in enumerate(served[1:]):
                position = len(prompt) + step
                start = 0 if window is None else max(0, position - window + 1)
                assert probs.shape == (1, full[layer].shape[1], 1, position + 1 - start), (family, layer, step)
                torch.testing.assert_close(
                    probs[0, :, 0],
                    full[layer][0, :, position, start : position + 1],
                    atol=TOL,
                    rtol=0,
                    msg=lambda m: f"{family} layer {layer} step {step}: {m}",
                )


def record_probabilities(llm: nnrun.LLM) -> dict:
    """Forward hooks on the attention modules: each asking request's per-layer, per-step probabilities."""
    runner = llm.runner
    recorded = {"steps": [], "by_request": {}}
    current = {}
    run_model = runner.run_model

    def recording_run_model(forward_batch):
        current["reqs"] = forward_batch.reqs
        num_decoding = sum(1 for n in forward_batch.extend_seq_lens if n == 1)
        recorded["steps"].append((forward_batch.forward_mode, num_decoding, len(forward_batch.reqs)))
        return run_model(forward_batch)

    def hook(module, args, output):
        probs = output[1]
        if probs is None:
            return
        assert isinstance(probs, AttentionProbs)
        for row, tensor in probs.by_row.items():
            request_id = current["reqs"][row].request_id
            recorded["by_request"].setdefault(request_id, {}).setdefault(module.layer_idx, []).append(tensor)

    runner.run_model = recording_run_model
    # Removed when the engine shuts down: the model outlives it, and a later engine's load-time probe
    # runs the model plainly (eager probabilities, not AttentionProbs).
    handles = [runner.model.get_submodule(path).register_forward_hook(hook) for path in attention_paths(runner.model)]
    recorded["remove_hooks"] = lambda: [handle.remove() for handle in handles]
    return recorded


# ---- the nnsight API, against nnsight on an eager HF model ------------------------------------


@pytest.fixture(scope="module")
def models():
    tokenizer = tiny_tokenizer()
    model = tiny_llama(seed=11)
    eager = twin(model)
    eager.set_attn_implementation("eager")
    oracle = hf_language_model(eager, tokenizer)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield oracle, ours
    ours.shutdown()


def test_trace_keyword_matches_nnsight_on_hf_eager(models):
    oracle, ours = models
    results = []
    for lm in (oracle, ours):
        with lm.trace(WORDS, output_attentions=True):
            probs = list().save()
            for i in range(3):
                probs.append(lm.model.layers[i].self_attn.output[1])
        results.append(probs)
    assert_same(results[0], results[1])


def test_multi_prompt_invoke_is_left_padded_as_hf_eager_pads_a_batch(models):
    """`[k, H, T_max, T_max]`: padded keys 0, a padded query row spread evenly, as HF's eager mask gives."""
    oracle, ours = models
    prompts = [WORDS, "the cat sat", "paris is the capital of france"]
    results = []
    for lm in (oracle, ours):
        with lm.trace(prompts, output_attentions=True):
            probs = lm.model.layers[1].self_attn.output[1].save()
        results.append(probs)
    assert results[1].shape == (3, 4, 8, 8)
    assert_same(results[0], results[1])


def test_multi_prompt_generation_steps_match_nnsight_on_hf_eager(models):
    oracle, ours = models
    prompts = [WORDS, "the cat sat"]
    results = []
    for lm in (oracle, ours):
        with lm.generate(prompts, max_new_tokens=3, output_attentions=True) as tracer:
            steps = list().save()
            for _ in tracer.iter[:3]:
                steps.append(lm.model.layers[2].self_attn.output[1])
        results.append(steps)
    assert [tuple(s.shape) for s in results[1]] == [(2, 4, 8, 8), (2, 4, 1, 9), (2, 4, 1, 10)]
    assert_same(results[0], results[1])


def test_only_invokes_that_ask_get_probabilities_and_the_others_are_bitwise_unchanged(models):
    _, ours = models
    runs = []
    for first_asks in (True, False):
        with ours.trace() as tracer:
            with tracer.invoke(WORDS, output_attentions=first_asks):
                first = ours.model.layers[0].self_attn.output[1].save()
            with tracer.invoke("the cat sat on the mat"):
                second = ours.model.layers[0].self_attn.output.save()
                hidden = ours.model.layers[2].output.save()
                logits = ours.lm_head.output.save()
        runs.append((first, second, hidden, logits))
    asked, quiet = runs
    assert asked[0].shape == (1, 4, 8, 8) and quiet[0] is None
    assert asked[1][1] is None and quiet[1][1] is None  # the second invoke never asked: sdpa's None
    for a, b in zip((asked[1][0], asked[2], asked[3]), (quiet[1][0], quiet[2], quiet[3])):
        assert torch.equal(a, b)


def test_invoke_keyword_overrides_the_trace_keyword(models):
    _, ours = models
    with ours.trace(output_attentions=True) as tracer:
        with tracer.invoke(WORDS):
            inherited = ours.model.layers[0].self_attn.output[1].save()
        with tracer.invoke("the cat sat", output_attentions=False):
            declined = ours.model.layers[0].self_attn.output[1].save()
    assert inherited.shape == (1, 4, 8, 8) and declined is None


def test_editing_probabilities_changes_nothing_downstream_as_on_hf(models):
    """output[1] is returned after the attention output is computed: in-place edits and assignments are
    seen by later reads of the block, and the model's output is unchanged, on HF and here alike."""
    oracle, ours = models
    results = []
    for lm in (oracle, ours):
        with lm.trace(WORDS, output_attentions=True):
            attn = lm.model.layers[0].self_attn
            attn.output[1][:] = 0.0
            zeroed = attn.output[1].save()
            out = attn.output
            attn.output = (out[0], torch.ones_like(out[1]))
            ones = lm.model.layers[0].self_attn.output[1].save()
            logits = lm.lm_head.output.save()
        with lm.trace(WORDS):
            clean = lm.lm_head.output.save()
        results.append((zeroed, ones, logits))
        torch.testing.assert_close(logits, clean, atol=1e-6, rtol=0)
    assert_same(results[0], results[1])
    assert float(results[1][0].abs().max()) == 0.0 and float(results[1][1].min()) == 1.0


def test_in_place_edits_of_a_multi_prompt_invoke_are_seen_by_its_later_reads(models):
    oracle, ours = models
    prompts = [WORDS, "the cat sat"]
    results = []
    for lm in (oracle, ours):
        with lm.trace(prompts, output_attentions=True):
            attn = lm.model.layers[1].self_attn
            attn.output[1][:, :, -1] = 0.0  # both prompts' last query row (a real token in each)
            again = attn.output[1].save()
            last_logits = lm.lm_head.output[:, -1].save()  # the padded positions' logits differ by convention
        results.append((again, last_logits))
    assert_same(results[0], results[1])
    assert float(results[1][0][:, :, -1].abs().max()) == 0.0


def test_refusals_name_the_keyword(models):
    _, ours = models
    with pytest.raises(TypeError, match="output_attentions must be True or False"):
        with ours.trace(WORDS, output_attentions="yes"):
            pass
    with pytest.raises(ValueError, match="empty invoke spans every prompt"):
        with ours.trace() as tracer:
            with tracer.invoke(WORDS, output_attentions=True):
                pass
            with tracer.invoke("the cat sat"):
                pass
            with tracer.invoke():
                ours.model.layers[0].self_attn.output[1].save()
    with pytest.raises(TypeError, match="output_hidden_states"):
        with ours.trace(WORDS, output_hidden_states=True):
            pass


# ---- the FlashInfer backend (emulated) and CUDA graphs ----------------------------------------


@pytest.fixture
def fake(monkeypatch):
    module = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


@pytest.mark.parametrize("family", ["gemma2", "qwen2", "llama"])
def test_flashinfer_backend_serves_hf_eager_probabilities(fake, family):
    model, oracle = sharp_pair(family)
    prompt = random_prompts([PROMPT_LEN], seed=6)[0]
    paths = attention_paths(model)
    tokens, expected = hf_generate_attentions(oracle, prompt, NUM_NEW)
    lm = nnrun.LanguageModel(model)
    try:
        use_flashinfer(lm.engine)
        with lm.generate(prompt, max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, output_attentions=True) as tracer:
            steps = list().save()
            for _ in tracer.iter[:NUM_NEW]:
                steps.append([envoy_at(lm, path).output[1] for path in paths])
    finally:
        lm.shutdown()
    assert any(call.kind == "run" for call in fake.calls)  # the emulated kernels served the step
    for step, (want_layers, have_layers) in enumerate(zip(expected, steps)):
        for layer, (want, have) in enumerate(zip(want_layers, have_layers)):
            assert have.shape == want.shape
            torch.testing.assert_close(have, want, atol=TOL, rtol=0, msg=lambda m: f"step {step} layer {layer}: {m}")


def test_decode_steps_whose_requests_ask_run_eagerly(fake):
    """A replayed graph runs no Python, so it cannot compute probabilities: such steps do not replay."""
    model = make_sharp_model("llama")
    params = nnrun.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with nnrun.LLM(model, page_size=4) as llm:
        use_flashinfer(llm)
        llm.runner.config.device.cuda_graph_batch_sizes = [1, 2, 4]
        capturer = RecordingCapturer()
        llm.runner.init_cuda_graphs(capturer=capturer)
        asked = llm.submit(random_prompts([5])[0], params, extra_args={OUTPUT_ATTENTIONS_ARG: True}).result()
        assert capturer.replays == 0
        quiet = llm.submit(random_prompts([5])[0], params).result()
        assert capturer.replays == 3
        assert asked.outputs[0].token_ids == quiet.outputs[0].token_ids
