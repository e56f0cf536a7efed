"""The FlashInfer backend with the real kernels (CUDA only; skipped elsewhere).

FlashInfer's attention kernels exist for float16 and bfloat16 only, so the HF comparisons run
the engine in half precision against an HF twin in float32 that holds the same (half-rounded)
weights. The first plan() of each kernel variant (dtype, head dim, window, softcap) JIT-compiles
it with nvcc, which can take minutes; set FLASHINFER_CUDA_ARCH_LIST (e.g. "9.0a") to compile for
the one GPU present. Head dims are 64, a size every FlashInfer backend instantiates.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import nnrun
from model_zoo import random_prompts
from nnrun.attention.score_terms import ScoreTerms
from nnrun.forward_batch import ForwardBatch, ForwardMode
from nnrun.hf_dtypes import cast_like_hf
from nnrun.memory import KVPool, LayerKVShape
from nnrun.model_probe import AttentionLayerInfo
from nnrun.request import Request
from test_cuda_graphs import count_replays

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
FAMILIES = ["llama", "qwen2", "gemma2", "gpt2"]  # GQA; a sliding layer; window + softcap; per-layer scale
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}  # on log-probabilities


def _config(family: str):
    if family == "llama":
        return LlamaForCausalLM, LlamaConfig(**_COMMON, head_dim=64)
    if family == "llama_hd128":  # the 8B shape's attention (head dim 128, 4 query heads per KV head): its kernels
        return LlamaForCausalLM, LlamaConfig(**{**_COMMON, "hidden_size": 512, "num_key_value_heads": 1}, head_dim=128)
    if family == "qwen2":
        return Qwen2ForCausalLM, Qwen2Config(
            **_COMMON,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        )
    if family == "gemma2":
        return Gemma2ForCausalLM, Gemma2Config(
            **_COMMON,
            head_dim=64,
            sliding_window=16,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=64,
        )
    return GPT2LMHeadModel, GPT2Config(
        vocab_size=VOCAB,
        n_embd=256,
        n_layer=2,
        n_head=4,
        n_positions=1024,
        bos_token_id=0,
        eos_token_id=0,
        scale_attn_by_inverse_layer_idx=True,
    )


def gpu_model(family: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random 2-layer model (head dim 64; `llama_hd128`: 128) in `dtype` on the CPU, queries sharpened 4x so windows and
    softcaps bind (at random init the attention logits are too small for tanh to matter)."""
    model_cls, config = _config(family)
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.q_proj.weight"):
                param.mul_(4.0)
    return cast_like_hf(model, dtype, in_place=True)  # as HF's loading in `dtype` leaves it (RoPE's inv_freq fp32)


def fp32_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The same half-rounded weights in float32 on the GPU, eager attention: the HF oracle."""
    twin = copy.deepcopy(model).float().to("cuda")
    twin.set_attn_implementation("eager")
    return twin


@torch.no_grad()
def oracle_log_probs(twin: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    logits = twin(torch.tensor([token_ids], device="cuda")).logits[0].float()  # [T, V]
    return torch.log_softmax(logits, dim=-1).cpu()


def engine(model: torch.nn.Module, backend: str, dtype: torch.dtype, **kwargs) -> nnrun.LLM:
    llm = nnrun.LLM(model, device="cuda", dtype=dtype, attention_backend=backend, **kwargs)
    assert llm.runner.attn_backend.name == backend
    return llm


def assert_matches_oracle(twin, prompts, outputs, tol: float) -> None:
    """Prompt logprobs within tol; every greedy token is the oracle's argmax or within tol of it."""
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "length", completion
        expected = oracle_log_probs(twin, prompt + completion.token_ids)  # [T, V]
        if output.prompt_logprobs is not None and len(prompt) > 1:  # a one-token prompt has none to check
            got = torch.tensor([entry[token] for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])])
            want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
            assert (got - want).abs().max() < tol
        for i, token in enumerate(completion.token_ids):
            row = expected[len(prompt) - 1 + i]
            assert row[token] >= row.max() - tol, (i, token, row.argmax().item())
            assert abs(completion.logprobs[i][token] - row[token].item()) < tol


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_engine_matches_hf_over_prefill_mixed_and_decode_steps(family):
    model = gpu_model(family, torch.bfloat16)
    twin = fp32_twin(model)
    prompts = random_prompts([1, 7, 33, 100, 250, 17], seed=11)
    params = nnrun.SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    with engine(model, "flashinfer", torch.bfloat16, page_size=16, max_num_batched_tokens=128) as llm:
        outputs = llm.generate(prompts, params)
    assert_matches_oracle(twin, prompts, outputs, TOL[torch.bfloat16])


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_fp16_engine_matches_hf_with_page_size_one(family):
    model = gpu_model(family, torch.float16)
    twin = fp32_twin(model)
    prompts = random_prompts([5, 40, 2, 30], seed=3)
    params = nnrun.SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    with engine(model, "flashinfer", torch.float16, page_size=1, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, params)
    assert_matches_oracle(twin, prompts, outputs, TOL[torch.float16])


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_prompt_logprobs_match_the_torch_backend(family):
    """Same model, same scheduler, same steps: FlashInfer against the reference backend."""
    prompts = random_prompts([3, 64, 1, 120, 29], seed=5)
    params = nnrun.SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    results = {}
    for backend in ("torch", "flashinfer"):
        with engine(
            gpu_model(family, torch.bfloat16), backend, torch.bfloat16, page_size=16, max_num_batched_tokens=64
        ) as llm:
            results[backend] = llm.generate(prompts, params)
    for prompt, reference, output in zip(prompts, results["torch"], results["flashinfer"]):
        if len(prompt) > 1:
            want = torch.tensor([e[t] for e, t in zip(reference.prompt_logprobs[1:], prompt[1:])])
            got = torch.tensor([e[t] for e, t in zip(output.prompt_logprobs[1:], prompt[1:])])
            assert (got - want).abs().max() < TOL[torch.bfloat16]
        first = output.outputs[0].token_ids[0]
        reference_first = reference.outputs[0].token_ids[0]
        if first != reference_first:  # only a near-tie may flip the greedy token
            lp = reference.outputs[0].logprobs[0][reference_first]
            assert abs(lp - output.outputs[0].logprobs[0][first]) < TOL[torch.bfloat16]


def test_float32_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        nnrun.LLM(gpu_model("llama", torch.float32), device="cuda", dtype="float32", attention_backend="flashinfer")


# ---- the backend alone against the torch backend, with plan/run counts -----------------------------------------

_LAYERS = [  # tensor-core decode (GQA group 4), a window with a softcap, plain MHA with another scale
    AttentionLayerInfo(0, 8, LayerKVShape(2, 64, 64), 0.125, None, None),
    AttentionLayerInfo(1, 8, LayerKVShape(2, 64, 64), 0.125, 16, 0.5),
    AttentionLayerInfo(2, 4, LayerKVShape(4, 64, 64), 0.0625, None, None),
]
PAGE_SIZE = 16


def _forward_batch(reqs: list[Request], new_lens: list[int], mode: ForwardMode) -> ForwardBatch:
    positions, out_cache_loc, kv_slots, starts, prefix_lens = [], [], [], [], []
    num_tokens = 0
    for req, new_len in zip(reqs, new_lens):
        prefix = req.num_tokens - new_len
        token_pos = torch.arange(req.num_tokens)
        slots = torch.tensor(req.page_ids)[token_pos // PAGE_SIZE] * PAGE_SIZE + token_pos % PAGE_SIZE  # [seq_len]
        starts.append(num_tokens)
        positions.append(token_pos[prefix:])
        out_cache_loc.append(slots[prefix:])
        kv_slots.append(slots)
        prefix_lens.append(prefix)
        num_tokens += new_len
    return ForwardBatch(
        mode,
        reqs,
        torch.zeros(num_tokens, dtype=torch.int64),
        torch.cat(positions),
        torch.cat(out_cache_loc),
        list(new_lens),
        starts,
        prefix_lens,
        kv_slots,
        torch.zeros(0, dtype=torch.int64),
        [],
    )


def test_backend_matches_torch_backend_and_plans_once_per_group_per_step():
    from nnrun.attention.flashinfer_backend import FlashInferAttnBackend
    from nnrun.attention.torch_backend import TorchAttnBackend

    device, dtype = torch.device("cuda"), torch.bfloat16
    shapes = [layer.kv_shape for layer in _LAYERS]
    flashinfer_backend = FlashInferAttnBackend(KVPool(shapes, 64, PAGE_SIZE, dtype, device), device, _LAYERS)
    torch_backend = TorchAttnBackend(KVPool(shapes, 64, PAGE_SIZE, dtype, device), device)
    counts = {"plan": 0, "run": 0}
    for wrapper in flashinfer_backend.prefill_wrappers + flashinfer_backend.decode_wrappers:
        for method in ("plan", "run"):
            original = getattr(wrapper, method)

            def counted(*args, _original=original, _method=method, **kwargs):
                counts[_method] += 1
                return _original(*args, **kwargs)

            setattr(wrapper, method, counted)

    pages = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()  # scattered page ids
    reqs = [Request(f"r{i}", [0] * n, nnrun.SamplingParams(max_tokens=1)) for i, n in enumerate([37, 130, 1])]
    for req, num_pages in zip(reqs, [4, 10, 2]):
        req.page_ids = [pages.pop() for _ in range(num_pages)]
    steps = [([37, 130, 1], ForwardMode.EXTEND), ([1, 20, 1], ForwardMode.EXTEND)]
    steps += [([1, 1, 1], ForwardMode.DECODE)] * 4
    generator = torch.Generator(device="cuda").manual_seed(0)
    for step_index, (new_lens, mode) in enumerate(steps):
        if step_index:
            for req, new_len in zip(reqs, new_lens):
                req.prompt_token_ids = req.prompt_token_ids + [0] * new_len
        forward_batch = _forward_batch(reqs, new_lens, mode)
        flashinfer_backend.init_forward_metadata(forward_batch)
        torch_backend.init_forward_metadata(forward_batch)
        assert counts["plan"] == len(flashinfer_backend.groups) * (step_index + 1)
        for layer in _LAYERS:
            n = forward_batch.num_tokens
            shape = layer.kv_shape
            q = torch.randn(n, layer.num_q_heads, shape.head_dim, device=device, generator=generator).to(dtype)
            k = torch.randn(n, shape.num_kv_heads, shape.head_dim, device=device, generator=generator).to(dtype)
            v = torch.randn(n, shape.num_kv_heads, shape.v_head_dim, device=device, generator=generator).to(dtype)
            terms = ScoreTerms(layer.scaling, layer.sliding_window, layer.softcap)
            got = flashinfer_backend.forward(layer.layer_idx, q, k, v, terms)
            want = torch_backend.forward(layer.layer_idx, q, k, v, terms)
            assert got.shape == want.shape and got.dtype == dtype
            assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (step_index, layer.layer_idx)
    assert counts["plan"] == len(flashinfer_backend.groups) * len(steps)
    assert counts["run"] == len(_LAYERS) * len(steps)


# ---- decode CUDA graphs and KV sizing --------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graph_replay_equals_eager_and_matches_hf(family):
    """Requests of different lengths shrink the decode batch through several captured sizes."""
    prompts = random_prompts([3, 17, 9, 1, 30, 12, 44, 5, 21], seed=13)
    params = [
        nnrun.SamplingParams(max_tokens=n, temperature=0, logprobs=0, ignore_eos=True)
        for n in (2, 9, 4, 7, 12, 5, 16, 3, 10)
    ]
    model = gpu_model(family, torch.bfloat16)
    twin = fp32_twin(model)
    outputs = {}
    for graphs in (False, True):
        with engine(
            copy.deepcopy(model),
            "flashinfer",
            torch.bfloat16,
            page_size=16,
            enable_cuda_graphs=graphs,
            cuda_graph_batch_sizes=[1, 2, 4, 8, 16],
        ) as llm:
            assert (llm.runner.graph_runner is not None) == graphs
            replays = count_replays(llm)
            outputs[graphs] = llm.generate(prompts, params)
            assert (replays["count"] == max(p.max_tokens for p in params) - 1) == graphs
    assert_matches_oracle(twin, prompts, outputs[True], TOL[torch.bfloat16])
    for eager, replayed in zip(outputs[False], outputs[True]):
        # the same kernels on the same inputs; FlashInfer may split the KV differently in graph mode
        assert replayed.outputs[0].token_ids == eager.outputs[0].token_ids
        for want, got, token in zip(
            eager.outputs[0].logprobs, replayed.outputs[0].logprobs, replayed.outputs[0].token_ids
        ):
            assert abs(got[token] - want[token]) < TOL[torch.bfloat16]


def test_decode_steps_run_in_graphs_by_default_on_cuda():
    with engine(gpu_model("llama", torch.bfloat16), "flashinfer", torch.bfloat16, max_num_seqs=32) as llm:
        assert llm.runner.graph_runner.batch_sizes == [1, 2, 4, 8, 16, 32]
        replays = count_replays(llm)
        llm.generate(random_prompts([5, 9]), nnrun.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert replays["count"] == 3


def test_kv_pool_fills_the_engines_share_of_the_card():
    """gpu_memory_utilization=0.3: after start-up the card is ~30% used (the profiled activations are
    freed again; the attention workspace and graphs come on top), and the pool got the rest of it."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = cast_like_hf(LlamaForCausalLM(config).eval(), torch.bfloat16, in_place=True)  # 32 KiB of KV per token
    total = torch.cuda.mem_get_info()[1]
    with engine(model, "flashinfer", torch.bfloat16, gpu_memory_utilization=0.3, max_num_seqs=4096) as llm:
        in_use = total - torch.cuda.mem_get_info()[0]
        pool = llm.runner.kv_pool
        pool_bytes = sum(t.numel() * t.element_size() for t in pool.k_pages + pool.v_pages)
        assert abs(in_use - 0.3 * total) < 3 * (1 << 30), in_use / total
        assert pool_bytes > 0.3 * total - 6 * (1 << 30), pool_bytes / total
        outputs = llm.generate(random_prompts([5, 9]), nnrun.SamplingParams(max_tokens=3, temperature=0))
        assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
