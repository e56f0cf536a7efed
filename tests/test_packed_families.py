"""Families whose HF modules need more than plain causal attention over `position_ids`, on the packed path.

Each model is built tiny from its own family's config with random weights (fp32). Three prompts of
different lengths run packed in one step and then decode greedily together; every logit must equal
the same prompt run alone through plain HF (eager attention, no cache), and every token HF's argmax.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import nnrun
from fake_cuda_graph import RecordingCapturer
from fake_flashinfer import make_fake_flashinfer
from nnrun.attention import selection
from nnrun.attention.flashinfer_backend import FlashInferAttnBackend
from nnrun.attention.flashinfer_plan import plan_paged_kv
from nnrun.attention.score_terms import ScoreTerms
from nnrun.memory import LayerKVShape
from nnrun.model_probe import AttentionLayerInfo, probe_attention_layers
from nnrun.position_adapters import adapt_positions, max_positions
from packed_probs import packed_attention_probs
from tolerance import assert_close_packed

VOCAB = 128
PROMPT_LENGTHS = (5, 11, 3)
DECODE_STEPS = 4
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def tiny_model(model_type: str, **overrides) -> torch.nn.Module:
    """A random-weight model of `model_type`'s causal-LM class, from its config with small sizes."""
    config = AutoConfig.for_model(model_type, **{**_SMALL, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def hf_twin(model: torch.nn.Module) -> torch.nn.Module:
    """An independent plain-HF copy (eager attention): the oracle."""
    twin = type(model)(copy.deepcopy(model.config)).eval()
    twin.load_state_dict(model.state_dict())
    twin.set_attn_implementation("eager")
    return twin


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of one prompt run alone through plain HF."""
    return model(torch.tensor([token_ids])).logits[0].float()


def prompts_of(lengths=PROMPT_LENGTHS, low: int = 3, seed: int = 1) -> list[list[int]]:
    """Token ids from `low` up: the special ids (pad, bos, eos) of these configs stay out of the prompts."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def packed_prompt_logits(llm: nnrun.LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's `[T, V]` logits from one packed prefill step of all of them."""
    runner = llm.runner
    params = nnrun.SamplingParams(max_tokens=1, prompt_logprobs=0)
    reqs = [llm.make_request(prompt, params) for prompt in prompts]
    try:
        for req in reqs:
            req.page_ids = runner.allocator.alloc(runner.allocator.pages_needed(req.num_tokens))
            req.req_pool_idx = runner.req_to_token_pool.alloc()
        forward_batch = runner.prepare_forward_batch_extend(reqs)
        output = runner.forward(forward_batch)
    finally:
        for req in reqs:
            runner.release_kv(req)
    return [
        torch.cat([prompt_rows, next_row[None]]).float()
        for prompt_rows, next_row in zip(output.prompt_logits, output.next_token_logits)
    ]


def assert_packed_matches_hf(
    model: torch.nn.Module,
    prompts: list[list[int]] | None = None,
    swap_backend: Callable[[nnrun.LLM], object] | None = None,
) -> None:
    """Packed prefill logits and greedy decode steps (tokens and logprobs) equal HF run one prompt at a time.

    `swap_backend` replaces the engine's attention backend before the first step (FlashInfer's, say).
    """
    prompts = prompts or prompts_of()
    oracle = hf_twin(model)
    name = model.config.model_type
    with nnrun.LLM(model, page_size=4) as llm:
        assert getattr(llm.runner, "exact_forward", None) is None, f"{name} is served by the exact path, not packed"
        if swap_backend is not None:
            swap_backend(llm)
        for prompt, logits in zip(prompts, packed_prompt_logits(llm, prompts)):
            assert_close_packed(logits, hf_logits(oracle, prompt), msg=f"{name} prefill of {len(prompt)} tokens")
        params = nnrun.SamplingParams(max_tokens=DECODE_STEPS, temperature=0, logprobs=0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        assert len(tokens) == DECODE_STEPS
        expected = torch.log_softmax(hf_logits(oracle, prompt + tokens), dim=-1)  # [T, V]
        for step, token in enumerate(tokens):
            row = expected[len(prompt) - 1 + step]
            assert token == row.argmax().item(), f"{name}: decode step {step} of a {len(prompt)}-token prompt"
            got = torch.tensor(output.outputs[0].logprobs[step][token])
            assert_close_packed(got, row[token], msg=f"{name}: logprob at decode step {step}")


# ---- attention sinks ----------------------------------------------------------------------------

SINK_FAMILIES = {
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "granite_swa": dict(sliding_window=4),
    "granitemoe_swa": dict(sliding_window=4),
    "flint": {},
    # sinks on the sliding layer only; v heads narrower than k heads
    "mimo_v2_flash": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        v_head_dim=8,
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse"],
    ),
}


@pytest.mark.parametrize("model_type", sorted(SINK_FAMILIES))
def test_attention_sinks_match_hf(model_type):
    model = tiny_model(model_type, **SINK_FAMILIES[model_type])
    assert any(getattr(module, "sinks", None) is not None for module in model.modules()), model_type
    with torch.no_grad():  # sinks big enough to take a visible share of every softmax
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.copy_(torch.linspace(-1.0, 2.0, module.sinks.numel()))
    assert_packed_matches_hf(model)


def test_sinks_change_hf_results():
    """Negative control: without its sinks the model's logits differ, so the comparisons above can fail."""
    model = tiny_model("gpt_oss", **SINK_FAMILIES["gpt_oss"])
    without = hf_twin(model)
    with torch.no_grad():
        for module in without.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.fill_(-1e4)  # exp(-1e4) is 0: no probability goes to the sink
    prompt = prompts_of()[1]
    assert (hf_logits(model, prompt) - hf_logits(without, prompt)).abs().max() > 1e-2


def test_sink_models_called_plainly_keep_their_sinks():
    """Outside an engine step the model is plain HF: the sinks reach HF's own eager attention."""
    model = tiny_model("gpt_oss", **SINK_FAMILIES["gpt_oss"])
    oracle = hf_twin(model)
    prompt = prompts_of()[1]
    with nnrun.LLM(model, page_size=4) as llm:
        assert_close_packed(hf_logits(llm.model, prompt), hf_logits(oracle, prompt), msg="gpt_oss called plainly")


# ---- chunked attention --------------------------------------------------------------------------

# Chunks of 4 tokens: the 5- and 11-token prompts and their decode steps cross chunk boundaries.
LLAMA4_TEXT = dict(attention_chunk_size=4, num_local_experts=2, intermediate_size_mlp=128, no_rope_layers=[1, 0])


def test_llama4_text_chunked_attention_matches_hf():
    model = tiny_model("llama4_text", **LLAMA4_TEXT)
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    assert_packed_matches_hf(model)


def test_llama4_chunked_attention_matches_hf():
    """`llama4` (the multimodal config) maps to the same causal LM, built from its text config."""
    config = AutoConfig.for_model("llama4", text_config={**_SMALL, **LLAMA4_TEXT})
    torch.manual_seed(0)
    assert_packed_matches_hf(AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval())


def test_llama4_query_temperature_follows_each_requests_positions():
    """NoPE layers scale queries by a temperature of the position; a floor of 2 makes it grow from position 1."""
    model = tiny_model("llama4_text", **LLAMA4_TEXT, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5)
    assert not model.model.layers[1].self_attn.use_rope  # the NoPE layer, where the temperature applies
    assert_packed_matches_hf(model)


def test_chunks_change_hf_results():
    """Negative control: with chunks longer than the prompt, HF's logits differ, so the tests above can fail."""
    model = tiny_model("llama4_text", **LLAMA4_TEXT)
    unchunked = hf_twin(model)
    unchunked.config.attention_chunk_size = 10_000
    prompt = prompts_of()[1]
    assert (hf_logits(model, prompt) - hf_logits(unchunked, prompt)).abs().max() > 1e-3


# ---- attention probabilities (HF's output_attentions) with sinks and chunks -------------------------


@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text"])
def test_attention_probabilities_with_sinks_and_chunks_match_hf_eager(model_type):
    """Asking requests get HF eager's probabilities: the sink's share left out of each row, chunks masked."""
    settings = SINK_FAMILIES["gpt_oss"] if model_type == "gpt_oss" else LLAMA4_TEXT
    model = tiny_model(model_type, **settings)
    oracle = hf_twin(model)
    prompts = prompts_of()
    seen = packed_attention_probs(
        model, prompts, lambda loaded: [m for m in loaded.modules() if type(m).__name__.endswith("Attention")]
    )
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = oracle(torch.tensor([prompt]), output_attentions=True).attentions  # per layer [1, H, T, T]
        for layer, want in enumerate(expected):
            assert_close_packed(seen[layer].for_row(row), want, msg=f"{model_type} layer {layer}, prompt {row}")


# ---- positions the model numbers itself ---------------------------------------------------------

_ENCODER_DECODER = dict(
    d_model=64,
    decoder_layers=2,
    encoder_layers=2,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    decoder_ffn_dim=128,
    encoder_ffn_dim=128,
)
# Configs whose default special ids lie outside the tiny vocabulary get small ones.
_SMALL_SPECIAL_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=0)
DECODER_POSITION_FAMILIES = {
    "bart": {},
    "mbart": {},
    "marian": _SMALL_SPECIAL_IDS,
    "pegasus": {},
    "plbart": {},
    "blenderbot": {},
    "blenderbot-small": {},
    "bigbird_pegasus": {},
}
PADDING_OFFSET_FAMILIES = [
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "roberta-prelayernorm",
    "camembert",
    "data2vec-text",
    "xmod",
]


@pytest.mark.parametrize("model_type", sorted(DECODER_POSITION_FAMILIES))
def test_encoder_decoder_derived_decoders_number_positions_per_request(model_type):
    """Their decoders number positions over the whole `[1, N]` input; each request must get its own."""
    assert_packed_matches_hf(tiny_model(model_type, **_ENCODER_DECODER, **DECODER_POSITION_FAMILIES[model_type]))


@pytest.mark.parametrize("model_type", PADDING_OFFSET_FAMILIES)
def test_roberta_style_positions_start_after_padding_idx(model_type):
    model = tiny_model(model_type, is_decoder=True, **_SMALL_SPECIAL_IDS)
    if model_type == "xmod":
        model.set_default_language("en_XX")  # its adapters pick a language; HF refuses to run without one
    assert_packed_matches_hf(model)


def test_adapted_models_called_plainly_number_positions_as_hf():
    """Outside an engine step an adapted module is HF's own: a plain call of the same model object is HF's."""
    model = tiny_model("bart", **_ENCODER_DECODER)
    oracle = hf_twin(model)
    prompt = prompts_of()[1]
    with nnrun.LLM(model, page_size=4):
        assert "forward" in vars(model.model.decoder.embed_positions)  # the adapter is installed
        assert_close_packed(hf_logits(model, prompt), hf_logits(oracle, prompt), msg="bart called plainly")


@pytest.mark.parametrize("model_type", ["bart", "roberta"])
def test_adapted_positions_survive_decode_cuda_graphs(monkeypatch, model_type):
    """A replayed graph runs no Python: the adapted modules must read the graph's static positions buffer."""
    monkeypatch.setitem(sys.modules, "flashinfer", make_fake_flashinfer())
    if model_type == "bart":
        model = tiny_model("bart", **_ENCODER_DECODER)
    else:
        model = tiny_model("roberta", is_decoder=True, **_SMALL_SPECIAL_IDS)
    oracle = hf_twin(model)
    prompts = prompts_of((5, 11, 3))
    with nnrun.LLM(model, page_size=4) as llm:
        _use_flashinfer(llm)
        llm.runner.config.device.cuda_graph_batch_sizes = [1, 2, 4]
        capturer = RecordingCapturer()
        llm.runner.init_cuda_graphs(capturer=capturer)
        params = nnrun.SamplingParams(max_tokens=DECODE_STEPS, temperature=0, logprobs=0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
    assert capturer.replays == DECODE_STEPS - 1  # every decode step replayed a graph
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        expected = torch.log_softmax(hf_logits(oracle, prompt + tokens), dim=-1)  # [T, V]
        for step, token in enumerate(tokens):
            row = expected[len(prompt) - 1 + step]
            assert token == row.argmax().item(), f"{model_type}: replayed decode step {step}"
            assert_close_packed(torch.tensor(output.outputs[0].logprobs[step][token]), row[token], msg=model_type)


def test_context_ends_where_the_position_table_ends():
    """A table of 256 positions numbered from padding_idx + 1 = 2 holds 254 tokens; whisper's decoder its own 64."""
    model = tiny_model("roberta", is_decoder=True, **_SMALL_SPECIAL_IDS)
    oracle = hf_twin(model)
    longest = prompts_of((253,))[0]  # with its one new token, the table's last row
    with nnrun.LLM(model, page_size=4) as llm:
        assert llm.runner.max_model_len == 254
        output = llm.generate([longest], nnrun.SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
        with pytest.raises(ValueError, match="254 tokens, but the context holds 254"):
            llm.generate([longest + [5]], nnrun.SamplingParams(max_tokens=1))
    expected = torch.log_softmax(hf_logits(oracle, longest)[-1], dim=-1)
    token = output.outputs[0].token_ids[0]
    assert token == expected.argmax().item()
    assert_close_packed(
        torch.tensor(output.outputs[0].logprobs[0][token]), expected[token], msg="roberta at its last position"
    )
    whisper = tiny_model("whisper", **_ENCODER_DECODER, **_SMALL_SPECIAL_IDS, max_target_positions=64)
    with nnrun.LLM(whisper, page_size=4) as llm:  # the decoder's table binds, not the config's 256 positions
        assert llm.runner.max_model_len == 64


def test_position_tables_grown_on_demand_set_no_limit():
    """XGLM's sinusoidal table grows with the positions asked for: adapted, it bounds nothing (and loads)."""
    from families.tiny import tiny_model as sweep_tiny_model

    model = sweep_tiny_model("xglm")
    assert adapt_positions(model) == ["model.embed_positions"]
    assert max_positions(model) is None
    with nnrun.LLM(model, page_size=4) as llm:
        assert llm.runner.max_model_len == model.config.max_position_embeddings


# ---- logits rows --------------------------------------------------------------------------------


def test_whisper_decoder_ignoring_logits_to_keep_samples_from_the_right_rows():
    model = tiny_model("whisper", **_ENCODER_DECODER, **_SMALL_SPECIAL_IDS)
    with nnrun.LLM(model, page_size=4) as llm:
        assert llm.runner.returns_every_position  # HF's WhisperForCausalLM returns every position's logits
    assert_packed_matches_hf(model)


def test_models_honouring_logits_to_keep_are_not_sliced_again():
    with nnrun.LLM(tiny_model("bart", **_ENCODER_DECODER), page_size=4) as llm:
        assert not llm.runner.returns_every_position


# ---- sparse-attention indexers ------------------------------------------------------------------


def test_sparse_attention_indexers_not_dsa_shaped_are_refused_by_name_on_the_packed_path():
    """DeepSeek-V4's indexer scores compressed key blocks (DSA indexers run packed: test_indexer_families.py)."""
    from families.tiny import tiny_model as sweep_tiny_model

    model = sweep_tiny_model("deepseek_v4")
    model.set_attn_implementation("nnrun_paged")
    with pytest.raises(ValueError, match=r"Indexer is a sparse-attention indexer .* the packed path does not run"):
        probe_attention_layers(model, torch.device("cpu"))


# ---- FlashInfer backend selection ---------------------------------------------------------------


def _layers(**settings) -> list[AttentionLayerInfo]:
    shape = LayerKVShape(num_kv_heads=2, head_dim=64, v_head_dim=64)
    return [
        AttentionLayerInfo(
            layer_idx=i, num_q_heads=4, kv_shape=shape, scaling=0.125, sliding_window=None, softcap=None, **settings
        )
        for i in range(2)
    ]


def test_auto_takes_flashinfer_for_sink_layers(monkeypatch):
    import nnrun.attention.flashinfer_backend as flashinfer_backend

    monkeypatch.setattr(selection, "_flashinfer_available", lambda: True)
    monkeypatch.setattr(flashinfer_backend, "FlashInferAttnBackend", lambda pool, device, layers: "flashinfer")
    pool = SimpleNamespace(k_pages=[torch.empty(0, dtype=torch.bfloat16)], page_size=16)
    backend = selection.create_attention_backend("auto", pool, torch.device("cuda"), _layers(has_sinks=True))
    assert backend == "flashinfer"


def test_auto_keeps_the_torch_backend_for_sinks_with_a_softcap_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(selection, "_flashinfer_available", lambda: True)
    monkeypatch.setattr(selection, "TorchAttnBackend", lambda pool, device: "torch")
    pool = SimpleNamespace(k_pages=[torch.empty(0, dtype=torch.bfloat16)], page_size=16)
    layers = [dataclasses.replace(layer, softcap=30.0) for layer in _layers(has_sinks=True)]
    with caplog.at_level(logging.INFO, logger=selection.__name__):
        assert selection.create_attention_backend("auto", pool, torch.device("cuda"), layers) == "torch"
    assert "layers [0, 1] have attention sinks and a softcap together" in caplog.text
    with pytest.raises(ValueError, match=r"attention_backend='flashinfer': layers \[0, 1\] have attention sinks"):
        selection.create_attention_backend("flashinfer", pool, torch.device("cuda"), layers)


# ---- attention sinks on the FlashInfer backend (its torch emulator on CPU) --------------------------


# mimo_v2_flash: sinks on its sliding layers only, and v heads narrower than k heads (no decode kernel, no graphs)
@pytest.mark.parametrize("model_type", ["gpt_oss", "granite_swa", "mimo_v2_flash"])
def test_sinks_on_the_flashinfer_backend_match_hf(monkeypatch, model_type):
    """The sink is applied from the kernel's base-2 log-sum-exp; prefill, decode and decode CUDA graphs."""
    fake = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    model = tiny_model(model_type, **SINK_FAMILIES[model_type])
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.copy_(torch.linspace(-1.0, 2.0, module.sinks.numel()))
    capturer = RecordingCapturer()
    backends = []

    def flashinfer_with_graphs(llm: nnrun.LLM) -> None:
        backends.append(_use_flashinfer(llm))
        llm.runner.config.device.cuda_graph_batch_sizes = [1, 2, 4]
        llm.runner.init_cuda_graphs(capturer=capturer)

    assert_packed_matches_hf(model, swap_backend=flashinfer_with_graphs)
    assert capturer.replays == (DECODE_STEPS - 1 if backends[0].supports_cuda_graphs else 0)
    assert any(call.kwargs.get("return_lse") for call in fake.calls if call.kind == "run")


# ---- chunked attention on the FlashInfer backend (its torch emulator on CPU) -------------------------


def _use_flashinfer(llm: nnrun.LLM) -> FlashInferAttnBackend:
    runner = llm.runner
    runner.attn_backend = FlashInferAttnBackend(runner.kv_pool, runner.device, runner.layers, workspace_bytes=1 << 16)
    return runner.attn_backend


@pytest.mark.parametrize("chunk_size", [4, 8])  # one page per chunk; two pages per chunk
def test_llama4_chunks_on_the_flashinfer_backend_match_hf(monkeypatch, chunk_size):
    fake = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    model = tiny_model("llama4_text", **{**LLAMA4_TEXT, "attention_chunk_size": chunk_size})
    assert_packed_matches_hf(model, prompts_of((5, 11, 3, 17)), swap_backend=_use_flashinfer)
    planned = [call.info["plan"] for call in fake.calls if call.kind == "plan"]
    assert any(len(plan.kv_last_page_len) > 4 for plan in planned)  # a chunked group split the prompts


def test_chunked_plan_gives_each_chunk_its_own_pages():
    """Hand-computed: 3 cached + 7 new tokens in chunks of 4 (pages of 2) are 3 planned requests."""
    plan = plan_paged_kv([3], [7], [[10, 11, 12, 13, 14]], page_size=2, chunk_size=4)
    # positions 3 | 4..7 | 8..9: the first sees keys 0..3 (pages 10, 11), the next 4..7 (12, 13), the last 8..9 (14)
    assert plan.qo_indptr.tolist() == [0, 1, 5, 7]
    assert plan.kv_indptr.tolist() == [0, 2, 4, 5]
    assert plan.kv_indices.tolist() == [10, 11, 12, 13, 14]
    assert plan.kv_last_page_len.tolist() == [2, 2, 2]


def test_chunks_that_split_a_page_keep_the_torch_backend():
    layers = _layers(chunk_size=6)
    pool = SimpleNamespace(k_pages=[torch.empty(0, dtype=torch.bfloat16)], page_size=4)
    with pytest.raises(ValueError, match=r"attention chunks of \[6\] tokens are not whole KV pages of 4 tokens"):
        selection.create_attention_backend("flashinfer", pool, torch.device("cuda"), layers)


# ---- the real FlashInfer kernels (CUDA only) ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_flashinfer_sinks_and_chunks_match_the_torch_backend():
    """On the real kernels: sinks from the log-sum-exp (a full and a sliding layer) and chunks of 2 pages."""
    pytest.importorskip("flashinfer")
    from nnrun.attention.torch_backend import TorchAttnBackend
    from nnrun.forward_batch import ForwardMode
    from nnrun.memory import KVPool
    from nnrun.request import Request
    from test_gpu_flashinfer import PAGE_SIZE, _forward_batch

    shape = LayerKVShape(2, 64, 64)
    layers = [
        AttentionLayerInfo(0, 8, shape, 0.125, None, None, has_sinks=True),
        AttentionLayerInfo(1, 8, shape, 0.125, 24, None, has_sinks=True),
        AttentionLayerInfo(2, 8, shape, 0.125, None, None, chunk_size=2 * PAGE_SIZE),
    ]
    device, dtype = torch.device("cuda"), torch.bfloat16
    flashinfer_backend = FlashInferAttnBackend(KVPool([shape] * 3, 64, PAGE_SIZE, dtype, device), device, layers)
    torch_backend = TorchAttnBackend(KVPool([shape] * 3, 64, PAGE_SIZE, dtype, device), device)
    sinks = torch.linspace(-1.0, 3.0, 8, device=device)  # [Hq]
    pages = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    reqs = [Request(f"r{i}", [0] * n, nnrun.SamplingParams(max_tokens=1)) for i, n in enumerate([37, 130, 1])]
    for req, num_pages in zip(reqs, [4, 10, 2]):
        req.page_ids = [pages.pop() for _ in range(num_pages)]
    steps = [([37, 130, 1], ForwardMode.EXTEND), ([1, 20, 1], ForwardMode.EXTEND)]
    steps += [([1, 1, 1], ForwardMode.DECODE)] * 3
    generator = torch.Generator(device="cuda").manual_seed(0)
    for step_index, (new_lens, mode) in enumerate(steps):
        if step_index:
            for req, new_len in zip(reqs, new_lens):
                req.prompt_token_ids = req.prompt_token_ids + [0] * new_len
        forward_batch = _forward_batch(reqs, new_lens, mode)
        flashinfer_backend.init_forward_metadata(forward_batch)
        torch_backend.init_forward_metadata(forward_batch)
        for layer in layers:
            n = forward_batch.num_tokens
            q = torch.randn(n, 8, 64, device=device, generator=generator).to(dtype)
            k = torch.randn(n, 2, 64, device=device, generator=generator).to(dtype)
            v = torch.randn(n, 2, 64, device=device, generator=generator).to(dtype)
            sink_logits = sinks if layer.has_sinks else None
            terms = ScoreTerms(0.125, layer.sliding_window, sinks=sink_logits, chunk_size=layer.chunk_size)
            got = flashinfer_backend.forward(layer.layer_idx, q, k, v, terms)
            want = torch_backend.forward(layer.layer_idx, q, k, v, terms)
            # bf16 inputs, two kernels' summation orders: the bound is bf16's, relative to the outputs' size
            assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (step_index, layer.layer_idx)
