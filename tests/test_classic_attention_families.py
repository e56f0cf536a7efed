"""Classic families whose attention is their own code (nnrun/attention/classic), on the packed path.

GPT-J, GPT-Neo, CodeGen, GPT-NeoX-Japanese, Bloom, Falcon, MPT and OpenAI GPT, built tiny (fp32, random
weights). The oracle is plain HF, one prompt at a time: packed prefill logits of three prompts of
different lengths, then greedy decode steps (tokens and logprobs); ALiBi on the torch backend and
on the FlashInfer backend (its torch emulator on CPU); an nnsight read of an attention submodule;
attention probabilities; and the adapted model called plainly, outside any engine step.
"""

from __future__ import annotations

import copy
import sys
import warnings
from typing import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

import nnrun
from fake_flashinfer import make_fake_flashinfer
from families.tiny import tiny_config
from nnrun.attention.classic import adapt_classic_attention
from nnrun.attention.flashinfer_backend import FlashInferAttnBackend
from nnrun.attention.flashinfer_plan import flashinfer_alibi_slopes, flashinfer_unplanned_features
from packed_probs import packed_attention_probs
from test_packed_families import assert_packed_matches_hf, prompts_of
from tolerance import PACKED_REL, assert_close_packed


def _set(**values) -> Callable[[PretrainedConfig], None]:
    def apply(config: PretrainedConfig) -> None:
        for name, value in values.items():
            setattr(config, name, value)

    return apply


def _mpt_six_heads_clipped(config: PretrainedConfig) -> None:
    config.n_heads, config.d_model = 6, 96  # not a power of two: MPT's own slope order
    config.attn_config.clip_qkv = 0.5


# name -> (model_type, config change): each family as the tiny sweep builds it, plus the variants
# that change its attention (local window, ALiBi, grouped or multi-query KV, head counts).
VARIANTS: dict[str, tuple[str, Callable[[PretrainedConfig], None] | None]] = {
    "gptj": ("gptj", None),
    "codegen": ("codegen", None),
    "gpt_neo_local_window": ("gpt_neo", _set(window_size=4)),  # layer 1 is local: a 4-token window binds
    "gpt_neox_japanese": ("gpt_neox_japanese", None),
    "bloom": ("bloom", None),
    "bloom_six_heads": ("bloom", _set(n_head=6, hidden_size=96)),
    "falcon_multi_query": ("falcon", None),
    "falcon_multi_head": ("falcon", _set(multi_query=False, num_kv_heads=4)),
    "falcon_grouped": ("falcon", _set(new_decoder_architecture=True, num_kv_heads=2)),
    "falcon_alibi": ("falcon", _set(alibi=True, multi_query=False, num_kv_heads=4)),
    "mpt": ("mpt", None),
    "mpt_six_heads_clipped": ("mpt", _mpt_six_heads_clipped),
    "openai_gpt": ("openai-gpt", None),  # no layer index of its own: numbered in model order
}
ALIBI_VARIANTS = ["bloom", "bloom_six_heads", "falcon_alibi", "mpt", "mpt_six_heads_clipped"]


def build(variant: str) -> torch.nn.Module:
    model_type, change = VARIANTS[variant]
    config = tiny_config(model_type)
    if change is not None:
        change(config)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def plain_twin(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy of `model` as plain HF built it (nothing adapted)."""
    twin = type(model)(copy.deepcopy(model.config)).eval()
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_classic_family_runs_packed_and_matches_hf(variant):
    assert_packed_matches_hf(build(variant))  # asserts the packed path serves it


def _use_flashinfer(llm: nnrun.LLM) -> None:
    runner = llm.runner
    runner.attn_backend = FlashInferAttnBackend(runner.kv_pool, runner.device, runner.layers, workspace_bytes=1 << 16)


@pytest.mark.parametrize("variant", ["bloom", "bloom_six_heads", "mpt", "mpt_six_heads_clipped"])
def test_alibi_on_the_flashinfer_backend_matches_hf(monkeypatch, variant):
    """Slopes that are FlashInfer's built-in ones run in its ALIBI mode: prefill and decode (the emulator on CPU)."""
    fake = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    assert_packed_matches_hf(build(variant), swap_backend=_use_flashinfer)
    plans = [call for call in fake.calls if call.kind == "plan"]
    assert plans and all(call.kwargs["pos_encoding_mode"] == "ALIBI" for call in plans)


def test_alibi_slopes_flashinfer_cannot_take_keep_the_torch_backend(monkeypatch):
    """Falcon's slopes (divided by sqrt(head_dim)) are not FlashInfer's built-in ones: its backend refuses them by name."""
    monkeypatch.setitem(sys.modules, "flashinfer", make_fake_flashinfer())
    with nnrun.LLM(build("falcon_alibi"), page_size=4) as llm:
        runner = llm.runner
        assert flashinfer_unplanned_features(runner.layers, runner.kv_pool.page_size) is not None
        with pytest.raises(ValueError, match="ALiBi slopes other than FlashInfer's built-in ones"):
            FlashInferAttnBackend(runner.kv_pool, runner.device, runner.layers, workspace_bytes=1 << 16)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 6, 8, 12, 16, 20, 32, 112])
def test_flashinfer_builtin_slopes_are_blooms_and_mpts(num_heads):
    from transformers.models.bloom import modeling_bloom
    from transformers.models.mpt import modeling_mpt

    bloom = modeling_bloom.build_alibi_tensor(torch.ones((1, 2)), num_heads, torch.float32)[:, 0, 1]  # slope * 1
    mpt = -modeling_mpt.build_mpt_alibi_tensor(num_heads, 2)[:, 0, 0]  # slope * -1
    assert flashinfer_alibi_slopes(num_heads) == pytest.approx(bloom.tolist(), rel=1e-6)
    assert flashinfer_alibi_slopes(num_heads) == pytest.approx(mpt.tolist(), rel=1e-6)


@pytest.mark.parametrize("variant", ["bloom", "falcon_alibi", "mpt"])
def test_load_time_probe_records_alibi_layers(variant):
    with nnrun.LLM(build(variant), page_size=4) as llm:
        assert [layer.has_alibi for layer in llm.runner.layers] == [True, True]


def test_without_its_alibi_bloom_would_differ_from_hf():
    """The slopes bind at these sizes: without them the logits move ten times past the packed tolerance and more."""
    model = build("bloom")
    prompt = prompts_of()[1]
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits
        for module in model.modules():
            if type(module).__name__ == "BloomAttention":
                module.beta = 0.0  # HF's own weight of the ALiBi term
        without = model(torch.tensor([prompt])).logits
    assert (without - expected).abs().max() > 10 * PACKED_REL * expected.abs().max()


@pytest.mark.parametrize(
    "variant, submodule",
    [
        ("gptj", lambda model: model.transformer.h[0].attn.out_proj),
        ("bloom", lambda model: model.transformer.h[1].self_attention.dense),
        ("falcon_alibi", lambda model: model.transformer.h[0].self_attention.query_key_value),
        ("mpt", lambda model: model.transformer.blocks[1].attn.out_proj),
        ("openai_gpt", lambda model: model.transformer.h[1].attn.c_attn),
    ],
)
def test_nnsight_reads_of_attention_submodules_match_hf_hooks(variant, submodule):
    """Reads inside a packed trace of two prompts equal a forward hook on plain HF, each prompt alone."""
    model = build(variant)
    oracle = plain_twin(model)
    prompts = prompts_of()[:2]
    expected = []
    handle = submodule(oracle).register_forward_hook(lambda module, args, output: expected.append(output))
    with torch.no_grad():
        for prompt in prompts:
            oracle(torch.tensor([prompt]))
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = nnrun.LanguageModel(model, max_num_seqs=4, max_model_len=64)
    try:
        assert lm.engine.runner.exact_forward is None, f"{variant} is served by the exact path, not packed"
        saved = []
        with lm.trace() as tracer:
            for prompt in prompts:
                with tracer.invoke(list(prompt)):
                    saved.append(submodule(lm).output.save())
    finally:
        lm.shutdown()
    for prompt, got, want in zip(prompts, saved, expected):
        assert_close_packed(got, want, msg=f"{variant}: a {len(prompt)}-token prompt")


@pytest.mark.parametrize("variant", ["bloom", "mpt_six_heads_clipped", "gpt_neo_local_window", "openai_gpt"])
def test_attention_probabilities_match_hf_eager(variant):
    """Requests that ask get HF eager's probabilities (ALiBi and the local window applied), per request."""
    model = build(variant)
    oracle = plain_twin(model)
    prompts = prompts_of()
    seen = packed_attention_probs(
        model, prompts, lambda loaded: [m for m in loaded.modules() if hasattr(m, "_nnrun_classic_attention")]
    )
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = oracle(torch.tensor([prompt]), output_attentions=True).attentions  # per layer [1, H, T, T]
        for layer, want in enumerate(expected):
            assert_close_packed(seen[layer].for_row(row), want, msg=f"{variant} layer {layer}, prompt {row}")


@pytest.mark.parametrize("variant", ["gptj", "gpt_neo_local_window", "bloom", "falcon_alibi", "mpt", "openai_gpt"])
def test_adapted_models_called_plainly_are_hf_exactly(variant):
    """Outside an engine step an adapted module is HF's own: same logits, cache and attention weights."""
    model = build(variant)
    oracle = plain_twin(model)
    assert adapt_classic_attention(model)
    ids = torch.tensor([prompts_of()[1]])
    with torch.no_grad():
        got = model(ids, output_attentions=True)
        want = oracle(ids, output_attentions=True)
        if getattr(want, "past_key_values", None) is not None:  # OpenAI GPT keeps no cache
            next_got = model(ids[:, -1:] + 1, past_key_values=got.past_key_values).logits
            next_want = oracle(ids[:, -1:] + 1, past_key_values=want.past_key_values).logits
            assert torch.equal(next_got, next_want)
    assert torch.equal(got.logits, want.logits)
    for got_layer, want_layer in zip(got.attentions, want.attentions):
        assert torch.equal(got_layer, want_layer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_alibi_on_real_flashinfer_matches_hf_in_bf16(model_type):
    """FlashInfer's own ALIBI kernels (64-dim heads, which its kernels are built for) against HF in float32."""
    from test_gpu_flashinfer import TOL, assert_matches_oracle, engine, fp32_twin

    config = tiny_config(model_type)
    config.hidden_size = 256  # 4 heads of 64 (MPT's config maps hidden_size to d_model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    twin = fp32_twin(model)
    prompts = prompts_of((1, 7, 33, 100, 17))
    params = nnrun.SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    with engine(model, "flashinfer", torch.bfloat16, page_size=16, max_num_batched_tokens=64) as llm:
        assert llm.runner.exact_forward is None and all(layer.has_alibi for layer in llm.runner.layers)
        outputs = llm.generate(prompts, params)
    assert_matches_oracle(twin, prompts, outputs, TOL[torch.bfloat16])


@pytest.mark.parametrize("variant", ["gptj", "falcon_alibi"])
def test_no_hf_mask_is_built_inside_a_packed_step(variant):
    """Inside a step the model bears nnrun's implementation name, so HF builds no [1, 1, N, N] mask; its own after."""
    model = build(variant)
    own_name = model.config._attn_implementation
    masks = []
    with nnrun.LLM(model, page_size=4) as llm:
        attention = [module for module in model.modules() if hasattr(module, "_nnrun_classic_attention")]
        handle = attention[0].register_forward_pre_hook(
            lambda module, args, kwargs: masks.append(kwargs.get("attention_mask", args[2:3] or None)),
            with_kwargs=True,
        )
        llm.generate([prompts_of()[1]], nnrun.SamplingParams(max_tokens=2, ignore_eos=True))
        handle.remove()
    assert masks and all(mask is None for mask in masks)
    assert model.config._attn_implementation == own_name


def test_gpt_neo_local_layers_are_probed_with_their_window():
    """GPT-Neo's local layers mask keys `window_size` back: HF's sliding window, recorded per layer at load."""
    with nnrun.LLM(build("gpt_neo_local_window"), page_size=4) as llm:
        assert [layer.sliding_window for layer in llm.runner.layers] == [None, 4]
        assert [layer.scaling for layer in llm.runner.layers] == [1.0, 1.0]  # GPT-Neo does not scale its scores
