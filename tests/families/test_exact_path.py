"""The load-time exactness probe and the exact path: never serve numbers that differ from the model's own HF forward."""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nnrun
from families.tiny import tiny_model
from nnrun import SamplingParams
from nnrun.extract import extract, load_activations

PROMPTS = [[5, 17, 33, 2, 41], [8, 9, 60, 61, 62, 70, 71, 90, 91, 92, 99], [30, 31, 32]]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int = 4) -> list[int]:
    """HF's own greedy generation of one prompt alone, with HF's own cache (no EOS: every step runs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return ids[0, len(prompt) :].tolist()


def tokens_of(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


class RunningMeanLayer(torch.nn.Module):
    """Adds the causal running mean of its input over the sequence: in one packed batch, that mixes requests."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        counts = torch.arange(1, hidden.shape[1] + 1, device=hidden.device)[None, :, None]
        return hidden + hidden.cumsum(dim=1) / counts


class NumbersItsOwnPositions(LlamaForCausalLM):
    """A model that ignores the position ids it is given and counts from its cache, as some HF families do."""

    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


def test_probe_keeps_an_exact_model_on_the_packed_path():
    with nnrun.LLM(tiny_llama()) as llm:
        assert llm.runner.exact_forward is None
        assert llm.runner.layers  # the paged KV pool serves its attention layers


def test_probe_sends_a_model_that_mixes_packed_requests_to_the_exact_path(caplog):
    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(model.model.layers[0].mlp.act_fn, RunningMeanLayer())
    expected = [hf_greedy(model, prompt) for prompt in PROMPTS]
    with caplog.at_level(logging.WARNING, logger="nnrun.exact.path"):
        llm = nnrun.LLM(model)
    with llm:
        assert llm.runner.exact_forward is not None
        assert tokens_of(llm.generate(PROMPTS, GREEDY)) == expected
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "llama" in messages[0] and "only when packed with other prompts" in messages[0]


def test_probe_sends_a_model_that_ignores_position_ids_to_the_exact_path():
    torch.manual_seed(0)
    model = NumbersItsOwnPositions(tiny_llama().config).eval()
    expected = [hf_greedy(model, prompt) for prompt in PROMPTS]
    with nnrun.LLM(model) as llm:
        assert llm.runner.exact_forward is not None
        assert "differ from HF's" in llm.runner.exact_forward.reason
        assert tokens_of(llm.generate(PROMPTS, GREEDY)) == expected


def test_forward_path_must_be_auto_or_exact():
    with pytest.raises(ValueError, match="ModelConfig.forward_path must be 'auto' or 'exact', got 'fast'"):
        nnrun.LLM(tiny_llama(), forward_path="fast")


def test_forced_exact_path_gives_the_packed_path_numbers():
    model = tiny_llama()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    with nnrun.LLM(model) as packed, nnrun.LLM(copy.deepcopy(model), forward_path="exact") as exact:
        assert packed.runner.exact_forward is None and exact.runner.exact_forward is not None
        ours, theirs = exact.generate(PROMPTS, params), packed.generate(PROMPTS, params)
    assert tokens_of(ours) == tokens_of(theirs)
    for a, b in zip(ours, theirs):
        for position_a, position_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert position_a.keys() == position_b.keys()
            # fp32 logprobs of two forwards that sum in different orders: equal up to rounding.
            assert all(abs(position_a[t] - position_b[t]) <= 1e-4 * (1 + abs(position_b[t])) for t in position_a)


def test_exact_path_preempts_and_resumes_requests_with_their_own_cache():
    model = tiny_model("gptj")
    expected = [hf_greedy(model, prompt, 12) for prompt in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with nnrun.LLM(model, page_size=4, max_total_tokens=40, forward_path="exact") as llm:  # pages for two at once
        assert llm.runner.exact_forward is not None
        hf_forward, scheduler = llm.runner.exact_forward, llm.core.scheduler
        run, held_while_waiting = hf_forward.run, []

        def watched_run(forward_batch):  # at each forward: HF caches of requests that are not running
            running = {req.request_id for req in scheduler.running}
            held_while_waiting.extend(rid for rid in hf_forward.caches if rid not in running)
            return run(forward_batch)

        hf_forward.run = watched_run
        assert tokens_of(llm.generate(PROMPTS, params)) == expected
        assert scheduler.num_preemptions > 0
        assert held_while_waiting == []  # a preempted request's HF cache went with its pages
        assert hf_forward.caches == {}  # finished requests leave no HF cache behind


def test_exact_path_streams_and_isolates_concurrent_requests():
    model = tiny_model("mamba")
    expected = [hf_greedy(model, prompt) for prompt in PROMPTS]
    with nnrun.LLM(model, forward_path="exact") as llm:
        assert llm.runner.exact_forward is not None
        with llm.paused():  # all three in the same steps
            handles = [llm.submit(prompt, GREEDY, stream=True) for prompt in PROMPTS]
        streamed = [[list(output.outputs[0].token_ids) for output in handle.stream()] for handle in handles]
    assert [steps[-1] for steps in streamed] == expected
    assert all(len(steps) == 4 for steps in streamed)


def test_exact_path_extracts_each_prompts_own_values(tmp_path):
    model = tiny_model("gpt_neo")
    modules = ["transformer.h.0", "transformer.h.1.mlp", "transformer.ln_f"]
    with nnrun.LLM(model, forward_path="exact") as llm:
        assert llm.runner.exact_forward is not None
        extract(llm, PROMPTS, modules, tmp_path, progress=False)
    store = load_activations(tmp_path)
    for i, prompt in enumerate(PROMPTS):
        captured = {}
        handles = [
            model.get_submodule(path).register_forward_hook(
                lambda m, a, out, path=path: captured.__setitem__(path, (out[0] if isinstance(out, tuple) else out)[0])
            )
            for path in modules
        ]
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]))
        for handle in handles:
            handle.remove()
        for path in modules:
            # the same HF forward of the same prompt: equal up to fp32 rounding of the stored copy
            torch.testing.assert_close(store[i][path], captured[path], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def nnsight_models():
    from conformance.models import hf_language_model, tiny_tokenizer, twin
    from conformance.models import tiny_llama as conformance_llama

    tokenizer = tiny_tokenizer()
    model = conformance_llama()
    oracle = hf_language_model(twin(model), tokenizer)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer, forward_path="exact")
    yield oracle, ours, tokenizer
    ours.shutdown()


# On the exact path each prompt has its own forward: an invoke over several prompts and a barrier
# (invokes meeting inside one forward) are refused by name. Every other scenario of the
# conformance suite saves what nnsight on HF saves.
OVER_SEVERAL_PROMPTS = ("direct_list_input", "empty_invoke", "list_invoke", "list_invoke_edit")
BARRIERS = ("barrier_shares_embeddings",)


# The fast tier runs these; `make test-all` runs every scenario.
FAST_SCENARIOS = (
    "save_layer_outputs",
    "invokes_of_different_lengths",
    "activation_patching",
    "steering_during_generation",
    "gradient_of_loss",
    "source_attention_interface",
    "list_invoke",
    "barrier_shares_embeddings",
)


def _scenarios() -> list:
    from conformance.scenarios import SCENARIOS

    return [
        name if name in FAST_SCENARIOS else pytest.param(name, marks=pytest.mark.slow) for name in sorted(SCENARIOS)
    ]


@pytest.mark.parametrize("name", _scenarios())
def test_exact_path_serves_nnsight_like_hf(nnsight_models, name):
    from conformance.compare import assert_same
    from conformance.scenarios import SCENARIOS

    oracle, ours, tokenizer = nnsight_models
    assert ours.engine.runner.exact_forward is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name in OVER_SEVERAL_PROMPTS:
            with pytest.raises(ValueError, match="exact path .* give each prompt its own tracer.invoke"):
                SCENARIOS[name](ours, tokenizer)
        elif name in BARRIERS:
            with pytest.raises(ValueError, match="tracer.barrier.* exact path, where each prompt has its own forward"):
                SCENARIOS[name](ours, tokenizer)
        else:
            assert_same(SCENARIOS[name](oracle, tokenizer), SCENARIOS[name](ours, tokenizer), name)


def test_exact_path_refuses_an_invoke_over_several_prompts_by_name(nnsight_models):
    _, ours, _ = nnsight_models
    with pytest.raises(ValueError, match="exact path .* give each prompt its own tracer.invoke"):
        with ours.trace(["the cat sat", "the dog ran fast"]):
            ours.model.layers[0].output.save()
    with ours.trace("the cat sat"):  # the engine goes on serving
        hidden = ours.model.layers[0].output.save()
    assert hidden.shape[:2] == (1, 3)


def test_probe_prompts_fit_the_context_and_the_kv_pool():
    from nnrun.exact.probe import probe_lengths

    assert probe_lengths(None, max_len=256, num_slots=1024, page_size=16) == [5, 11, 3]
    assert probe_lengths(20, max_len=256, num_slots=1024, page_size=16) == [5, 22, 3]  # crosses the window
    assert probe_lengths(None, max_len=8, num_slots=1024, page_size=16) == [5, 7, 3]  # room for the decode token
    assert probe_lengths(None, max_len=256, num_slots=32, page_size=16) == [5, 11]
    assert probe_lengths(None, max_len=256, num_slots=4, page_size=4) == [3]
    assert probe_lengths(None, max_len=256, num_slots=1024, page_size=16, max_prompts=2) == [5, 11]


@pytest.mark.parametrize("limits", [dict(max_model_len=6, page_size=4, max_total_tokens=8), dict(max_num_seqs=1)])
def test_small_engine_limits_keep_an_exact_model_on_the_packed_path(limits):
    with nnrun.LLM(tiny_llama(), **limits) as llm:
        assert llm.runner.exact_forward is None


def test_exact_path_serves_hf_eager_attention_probabilities():
    from model_zoo import make_model, make_twin

    model = make_model("llama")
    oracle = make_twin(model)
    prompt = [3, 5, 7, 9, 11, 13]
    with torch.no_grad():
        expected = oracle(torch.tensor([prompt]), output_attentions=True).attentions
    lm = nnrun.LanguageModel(model, forward_path="exact")
    try:
        got = []
        with lm.trace(prompt, output_attentions=True):
            for layer in lm.model.layers:
                got.append(layer.self_attn.output[1].save())
        with lm.trace(prompt):  # not asked: None, as HF's sdpa gives
            unasked = lm.model.layers[0].self_attn.output[1].save()
    finally:
        lm.shutdown()
    assert unasked is None
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6)  # the same eager forward, one prompt alone


def test_an_encoder_only_head_is_refused_naming_family_and_reason():
    from transformers import BertConfig, BertForMaskedLM

    from nnrun.exact import ModelRefusedError

    config = BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    with pytest.raises(ModelRefusedError, match=r"bert: BertForMaskedLM cannot generate text .*encoder-only"):
        nnrun.LLM(BertForMaskedLM(config).eval())


def test_serve_and_extract_commands_take_the_exact_path(tmp_path, capsys):
    import argparse

    from nnrun.cli import main
    from nnrun.serve.command import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert (
        build_config(parser.parse_args(["tiny-facts", "--forward-path", "exact"])).engine_kwargs["forward_path"]
        == "exact"
    )
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat sat\nparis is the capital of\n")
    args = ["extract", "--model", "tiny-facts", "--input", str(prompts), "--module", "model.layers.1", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "packed")]) == 0
    assert main([*args, "--out", str(tmp_path / "exact"), "--forward-path", "exact"]) == 0
    assert capsys.readouterr().err == ""
    settings = [json.loads((tmp_path / name / "manifest.json").read_text())["settings"] for name in ("packed", "exact")]
    assert settings[0]["batch_prompts"] > 1 and settings[1]["batch_prompts"] == 1  # one prompt per HF forward
    packed, exact = load_activations(tmp_path / "packed"), load_activations(tmp_path / "exact")
    for i in range(2):
        # the same prompt through the packed path and through HF's own forward: fp32 summation order only
        torch.testing.assert_close(exact[i]["model.layers.1"], packed[i]["model.layers.1"], rtol=1e-4, atol=1e-5)
