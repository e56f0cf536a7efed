"""Decoder-only families whose attention needed more than the interface to run packed: XGLM.

Each model is built tiny (fp32, random weights). The oracle is plain HF run one prompt at a time:
packed prefill logits of prompts of different lengths, greedy decode tokens (bitwise) and logprobs,
attention probabilities against HF eager's, and the load-time probe's verdict.
"""

from __future__ import annotations

import warnings

import torch
from transformers import AutoModelForCausalLM

import nnrun
from families.sweep import check_family
from families.tiny import tiny_config
from nnrun.position_adapters import SINUSOIDAL_POSITIONS, adapt_positions
from packed_probs import packed_attention_probs
from test_packed_families import assert_packed_matches_hf, hf_logits, hf_twin, prompts_of
from tolerance import assert_close_packed


def build(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32).eval()


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
