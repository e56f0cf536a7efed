"""Decoder-only families whose attention needed more than the interface to run packed: XGLM, Inkling, DiffLlama.

Each model is built tiny (fp32, random weights). The oracle is plain HF run one prompt at a time:
packed prefill logits of prompts of different lengths, greedy decode tokens (bitwise) and logprobs,
attention probabilities against HF eager's, and the load-time probe's verdict.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnrun
from fake_flashinfer import make_fake_flashinfer
from families.sweep import check_family
from families.tiny import tiny_config
from nnrun.attention.flashinfer_backend import FlashInferAttnBackend
from nnrun.attention.flashinfer_plan import flashinfer_unplanned_features
from nnrun.position_adapters import SINUSOIDAL_POSITIONS, adapt_positions
from packed_probs import packed_attention_probs
from test_packed_families import DECODE_STEPS, assert_packed_matches_hf, hf_logits, hf_twin, prompts_of
from tolerance import PACKED_REL, assert_close_packed


def build(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32).eval()


def assert_greedy_matches_hf(oracle: torch.nn.Module, prompts: list[list[int]], outputs: list, name: str) -> None:
    """Greedy tokens equal HF's argmax (bitwise) and their logprobs HF's, each prompt run alone."""
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        expected = torch.log_softmax(hf_logits(oracle, prompt + tokens), dim=-1)  # [T, V]
        for step, token in enumerate(tokens):
            row = expected[len(prompt) - 1 + step]
            assert token == row.argmax().item(), f"{name}: decode step {step} of a {len(prompt)}-token prompt"
            got = torch.tensor(output.outputs[0].logprobs[step][token])
            assert_close_packed(got, row[token], msg=f"{name}: logprob at decode step {step}")


# ---- XGLM: attention of its own (nnrun/attention/classic/xglm.py), sinusoidal positions ----------


def test_xglm_runs_packed_and_matches_hf():
    assert_packed_matches_hf(build("xglm"))


def test_xglm_is_served_packed_by_the_load_time_probe():
    assert check_family("xglm").path == "packed"


def test_xglm_attention_probabilities_match_hf_eager():
    model = build("xglm")
    oracle = hf_twin(model)
    prompts = prompts_of()
    seen = packed_attention_probs(
        model, prompts, lambda loaded: [m for m in loaded.modules() if hasattr(m, "_nnrun_classic_attention")]
    )
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = oracle(torch.tensor([prompt]), output_attentions=True).attentions  # per layer [1, H, T, T]
        for layer, want in enumerate(expected):
            assert_close_packed(seen[layer].for_row(row), want, msg=f"xglm layer {layer}, prompt {row}")


def test_xglm_runs_packed_to_the_last_position_of_its_table():
    """The sinusoidal table numbers the step's ids (HF adds its offset of 2) up to max_position_embeddings."""
    model = build("xglm")
    assert adapt_positions(model) == ["model.embed_positions"]
    assert model.model.embed_positions._nnrun_position_adapter is SINUSOIDAL_POSITIONS
    oracle = hf_twin(model)
    last = model.config.max_position_embeddings - 1
    prompts = prompts_of((last, 4))  # the long prompt's one new token sits at the table's last position
    with nnrun.LLM(model, page_size=4) as llm:
        assert llm.runner.exact_forward is None and llm.runner.max_model_len == last + 1
        outputs = llm.generate(prompts, nnrun.SamplingParams(max_tokens=1, temperature=0, logprobs=0))
    for prompt, output in zip(prompts, outputs):
        expected = torch.log_softmax(hf_logits(oracle, prompt)[-1], dim=-1)  # [V]
        token = output.outputs[0].token_ids[0]
        assert token == expected.argmax().item()
        assert_close_packed(torch.tensor(output.outputs[0].logprobs[0][token]), expected[token], msg="xglm")


def test_xglm_positions_bind():
    """The same tokens at other positions give other logits: a packed step that numbered them wrong would fail."""
    model = build("xglm")
    ids = torch.tensor([prompts_of()[0]])
    with torch.no_grad():
        at_start = model(ids).logits
        shifted = model(ids, position_ids=torch.arange(7, 7 + ids.shape[1])[None]).logits
    assert (at_start - shifted).abs().max() > 1e-2


# ---- Inkling, Inkling 2: logits per query and key distance, Inkling 2's sinks per query ----------
# (nnrun/attention/classic/inkling.py)

# Small enough that every limit binds over these prompts (3 to 11 tokens, 4 decode steps): a 4-token
# window on the sliding layer (whose relative extent is the window), relative logits 6 back on the full
# layer, and HF's log scaling of queries and logits from position 2 on.
INKLING = dict(
    sliding_window_size=4,
    rel_extent=6,
    log_scaling_n_floor=2,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=16,
    logits_mup_width_multiplier=1.0,  # Inkling divides its logits by it (24): undivided, they are not near-uniform
)


def build_inkling(model_type: str = "inkling_text", **overrides) -> torch.nn.Module:
    config = tiny_config(model_type)
    for name, value in {**INKLING, **overrides}.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # logits by distance big enough to move the softmax visibly
        for module in model.modules():
            if type(module).__name__.endswith("RelativeLogits"):
                module.proj.normal_(std=2.0)
    return model


def test_inkling_runs_packed_and_matches_hf():
    assert_packed_matches_hf(build_inkling())


def test_inkling_without_log_scaling_matches_hf():
    assert_packed_matches_hf(build_inkling(log_scaling_n_floor=None))


def test_inkling2_with_per_query_sinks_runs_packed_and_matches_hf():
    assert_packed_matches_hf(build_inkling("inkling2_text"))


@pytest.mark.parametrize("model_type", ["inkling_text", "inkling2_text"])
def test_inkling_chunked_prefills_beside_decodes_match_hf(model_type):
    """Steps of at most 6 tokens: prompts split into chunks after a cached prefix, and decodes in the same steps."""
    model = build_inkling(model_type)
    oracle = hf_twin(model)
    prompts = prompts_of((5, 11, 3, 9))
    params = nnrun.SamplingParams(max_tokens=DECODE_STEPS, temperature=0, logprobs=0, ignore_eos=True)
    with nnrun.LLM(model, page_size=4, max_num_batched_tokens=6) as llm:
        assert llm.runner.exact_forward is None
        outputs = llm.generate(prompts, params)
    assert_greedy_matches_hf(oracle, prompts, outputs, model_type)


@pytest.mark.parametrize("model_type", ["inkling_text", "inkling2_text"])
def test_inkling_is_served_packed_by_the_load_time_probe(model_type):
    assert check_family(model_type).path == "packed"


def test_inkling_layers_are_probed_with_relative_logits_and_kept_off_flashinfer():
    with nnrun.LLM(build_inkling(), page_size=4) as llm:
        layers = llm.runner.layers
        assert [layer.has_relative_logits for layer in layers] == [True, True]
        assert [layer.sliding_window for layer in layers] == [4, None]
        assert "relative logits" in flashinfer_unplanned_features(layers, 4)


@pytest.mark.parametrize("model_type", ["inkling_text", "inkling2_text"])
def test_inkling_attention_probabilities_match_hf_eager(model_type):
    model = build_inkling(model_type)
    oracle = hf_twin(model)
    prompts = prompts_of()
    seen = packed_attention_probs(
        model, prompts, lambda loaded: [m for m in loaded.modules() if hasattr(m, "_nnrun_classic_attention")]
    )
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = oracle(torch.tensor([prompt]), output_attentions=True).attentions  # per layer [1, H, T, T]
        assert len(expected) == len(seen) == 2
        for layer, want in enumerate(expected):
            assert_close_packed(seen[layer].for_row(row), want, msg=f"{model_type} layer {layer}, prompt {row}")


def test_inkling_relative_logits_and_log_scaling_bind():
    """Without the bias, or without the log scaling, HF's own logits move far past the packed tolerance."""
    model = build_inkling()
    ids = torch.tensor([prompts_of()[1]])
    with torch.no_grad():
        expected = model(ids).logits
        model.config.log_scaling_n_floor = None
        unscaled = model(ids).logits
        model.config.log_scaling_n_floor = INKLING["log_scaling_n_floor"]
        for module in model.modules():
            if type(module).__name__ == "InklingRelativeLogits":
                module.proj.zero_()
        unbiased = model(ids).logits
    for changed in (unscaled, unbiased):
        assert (changed - expected).abs().max() > 100 * PACKED_REL * expected.abs().max()


# ---- DiffLlama: two attention calls per layer over one query and key (nnrun/attention/classic/diffllama.py) --


def test_diffllama_runs_packed_and_matches_hf():
    assert_packed_matches_hf(build("diffllama"))


def test_diffllama_is_served_packed_by_the_load_time_probe():
    assert check_family("diffllama").path == "packed"


def test_diffllama_pages_one_kv_per_layer_with_both_values():
    """One attention call per layer; its values are both of HF's calls' values side by side (2 x head_dim)."""
    model = build("diffllama")
    with nnrun.LLM(model, page_size=4) as llm:
        layers = llm.runner.layers
    head_dim = model.config.head_dim
    assert [layer.layer_idx for layer in layers] == [0, 1]
    assert [(layer.kv_shape.head_dim, layer.kv_shape.v_head_dim) for layer in layers] == [(head_dim, 2 * head_dim)] * 2


def test_diffllama_chunked_prefills_beside_decodes_match_hf():
    model = build("diffllama")
    oracle = hf_twin(model)
    prompts = prompts_of((5, 11, 3, 9))
    params = nnrun.SamplingParams(max_tokens=DECODE_STEPS, temperature=0, logprobs=0, ignore_eos=True)
    with nnrun.LLM(model, page_size=4, max_num_batched_tokens=6) as llm:
        assert llm.runner.exact_forward is None
        outputs = llm.generate(prompts, params)
    assert_greedy_matches_hf(oracle, prompts, outputs, "diffllama")


def test_diffllama_attention_probabilities_match_hf_eager():
    model = build("diffllama")
    oracle = hf_twin(model)
    prompts = prompts_of()
    seen = packed_attention_probs(
        model, prompts, lambda loaded: [m for m in loaded.modules() if hasattr(m, "_nnrun_classic_attention")]
    )
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = oracle(torch.tensor([prompt]), output_attentions=True).attentions  # per layer [1, H, T, T]
        for layer, want in enumerate(expected):
            assert_close_packed(seen[layer].for_row(row), want, msg=f"diffllama layer {layer}, prompt {row}")


def test_diffllama_on_the_flashinfer_backend_matches_hf(monkeypatch):
    """Values twice as wide as keys plan FlashInfer's prefill wrapper (`head_dim_vo`) in decode steps too (its emulator)."""
    fake = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)

    def use_flashinfer(llm: nnrun.LLM) -> None:
        runner = llm.runner
        runner.attn_backend = FlashInferAttnBackend(
            runner.kv_pool, runner.device, runner.layers, workspace_bytes=1 << 16
        )

    assert_packed_matches_hf(build("diffllama"), swap_backend=use_flashinfer)
    plans = [call for call in fake.calls if call.kind == "plan"]
    assert plans and all(call.kwargs["head_dim_vo"] == 2 * build("diffllama").config.head_dim for call in plans)


# ---- interpretability: nnsight reads of the adapted attention ---------------------------------

BUILDERS = {
    "xglm": lambda: build("xglm"),
    "inkling_text": build_inkling,
    "inkling2_text": lambda: build_inkling("inkling2_text"),
    "diffllama": lambda: build("diffllama"),
}


@pytest.mark.parametrize("model_type", sorted(BUILDERS))
def test_nnsight_reads_of_the_adapted_attention_match_hf_hooks(model_type):
    """`self_attn.output[0]` inside a packed trace of two prompts equals a forward hook on plain HF, each prompt alone."""
    model = BUILDERS[model_type]()
    oracle = hf_twin(model)
    prompts = prompts_of()[:2]
    expected = []
    handle = oracle.model.layers[1].self_attn.register_forward_hook(lambda module, args, out: expected.append(out[0]))
    with torch.no_grad():
        for prompt in prompts:
            oracle(torch.tensor([prompt]))
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = nnrun.LanguageModel(model, max_num_seqs=4, max_model_len=64)
    try:
        assert lm.engine.runner.exact_forward is None, f"{model_type} is served by the exact path, not packed"
        saved = []
        with lm.trace() as tracer:
            for prompt in prompts:
                with tracer.invoke(list(prompt)):
                    saved.append(lm.model.layers[1].self_attn.output[0].save())
    finally:
        lm.shutdown()
    for prompt, got, want in zip(prompts, saved, expected):
        assert_close_packed(got, want, msg=f"{model_type}: a {len(prompt)}-token prompt")
