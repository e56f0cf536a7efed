"""The FlashInfer backend's real code on CPU, with a torch emulator standing in for the kernels.

The emulator (tests/fake_flashinfer.py) sees only what the backend plans (CSR page tables, window,
softcap, scale), so matching plain HF here checks the planner and the wrapper calls end to end.
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

import nnrun
from fake_flashinfer import Call, make_fake_flashinfer
from model_zoo import hf_logits, make_model, make_twin, random_prompts
from nnrun.attention.flashinfer_backend import FlashInferAttnBackend
from nnrun.attention.score_terms import ScoreTerms
from nnrun.attention.torch_backend import TorchAttnBackend
from nnrun.forward_batch import ForwardBatch, ForwardMode
from nnrun.memory import KVPool, LayerKVShape
from nnrun.model_probe import AttentionLayerInfo
from nnrun.request import Request
from tolerance import assert_close_packed

TOL = 1e-4
WORKSPACE_BYTES = 1 << 16  # the emulator never touches it; the real default is 128 MiB
FAMILIES = ["llama", "qwen2", "gemma2", "gpt2"]  # GQA; a sliding layer; window + softcap; per-layer scale


def make_sharp_model(family: str) -> torch.nn.Module:
    """A zoo model with 8x larger queries: at random init attention logits are so small that
    Gemma2's 0.5 softcap (tanh) moves decode logprobs by < 1e-4; sharper attention makes the
    softcap, the window and the causal mask all bind at the tolerance used here."""
    model = make_model(family)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.q_proj.weight"):
                param.mul_(8.0)
    return model


@pytest.fixture
def fake(monkeypatch):
    module = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def use_flashinfer(llm: nnrun.LLM) -> FlashInferAttnBackend:
    """Swap the engine's attention for FlashInfer (the engine picks it only on CUDA by itself)."""
    runner = llm.runner
    backend = FlashInferAttnBackend(runner.kv_pool, runner.device, runner.layers, workspace_bytes=WORKSPACE_BYTES)
    runner.attn_backend = backend
    return backend


def record_steps(backend: FlashInferAttnBackend, calls: list) -> None:
    """Interleave step and layer markers with the fake's plan/run records."""
    init, forward = backend.init_forward_metadata, backend.forward

    def marked_init(forward_batch):
        calls.append(Call("step", None, {"mode": forward_batch.forward_mode}))
        init(forward_batch)

    def marked_forward(layer_idx, *args, **kwargs):
        calls.append(Call("forward", None, {"layer": layer_idx}))
        return forward(layer_idx, *args, **kwargs)

    backend.init_forward_metadata, backend.forward = marked_init, marked_forward


def assert_greedy_matches_hf(oracle, prompts, outputs) -> None:
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "length", completion
        expected = torch.log_softmax(hf_logits(oracle, prompt + completion.token_ids), dim=-1)  # [T, V]
        for i, token in enumerate(completion.token_ids):
            position = len(prompt) - 1 + i
            assert token == expected[position].argmax().item()
            assert abs(completion.logprobs[i][token] - expected[position, token].item()) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_matches_hf(fake, family):
    """Prompt logprobs of a packed prefill (page 16), then all-decode steps."""
    model = make_sharp_model(family)
    oracle = make_twin(model)
    prompts = random_prompts([1, 7, 33])
    with nnrun.LLM(model, page_size=16) as llm:
        use_flashinfer(llm)
        params = nnrun.SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0, logprobs=0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        expected = torch.log_softmax(hf_logits(oracle, prompt), dim=-1)  # [T, V]
        got = [entry[token] for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
        want = [expected[i, token].item() for i, token in enumerate(prompt[1:])]
        assert_close_packed(torch.tensor(got), torch.tensor(want), rel=TOL, msg=family)
    assert_greedy_matches_hf(oracle, prompts, outputs)
    kinds = {type(call.wrapper).__name__ for call in fake.calls if call.kind == "run"}
    assert kinds == {"BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper"}


@pytest.mark.parametrize("family", FAMILIES)
def test_decodes_mixed_with_new_prefills_on_descending_pages_match_hf(fake, family):
    """Page size 3 divides no prompt length; a small token budget admits prompts over several steps."""
    model = make_sharp_model(family)
    oracle = make_twin(model)
    prompts = random_prompts([5, 30, 2, 20, 11], seed=3)
    with nnrun.LLM(model, page_size=3, max_num_batched_tokens=24) as llm:
        llm.runner.allocator._free_pages.reverse()  # high page ids first: tables run downwards
        backend = use_flashinfer(llm)
        record_steps(backend, fake.calls)
        outputs = llm.generate(prompts, nnrun.SamplingParams(max_tokens=5, temperature=0, logprobs=0, ignore_eos=True))
    assert_greedy_matches_hf(oracle, prompts, outputs)
    plans = [call.info["plan"] for call in fake.calls if call.kind == "plan"]
    mixed = [p for p in plans if p.qo_indptr.diff().max() > 1 and (p.qo_indptr.diff() == 1).any()]
    assert mixed, "no step mixed decodes with prefills"
    assert any(p.kv_indices.diff().lt(0).any() for p in plans)


def test_sharp_gemma2_softcap_binds_at_the_last_position():
    """Negative control for the tests above: dropping the softcap moves a last-token logprob."""
    model = make_sharp_model("gemma2")
    uncapped = make_twin(model)
    uncapped.config.attn_logit_softcapping = None
    uncapped = make_twin(uncapped)
    prompt = random_prompts([10])[0]
    capped_lp = torch.log_softmax(hf_logits(make_twin(model), prompt)[-1], dim=-1)
    assert (capped_lp - torch.log_softmax(hf_logits(uncapped, prompt)[-1], dim=-1)).abs().max() > 1e-3


def test_page_size_one_with_window_and_softcap(fake):
    model = make_sharp_model("gemma2")
    oracle = make_twin(model)
    prompts = random_prompts([20, 3, 9], seed=5)
    with nnrun.LLM(model, page_size=1, max_num_batched_tokens=16) as llm:
        use_flashinfer(llm)
        outputs = llm.generate(prompts, nnrun.SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True))
    assert_greedy_matches_hf(oracle, prompts, outputs)


def test_plan_once_per_group_per_step_and_one_run_per_layer(fake):
    """Gemma2 has two plan groups (sliding and full layers); plans happen only before the forward."""
    model = make_model("gemma2")
    prompts = random_prompts([5, 40, 2, 30], seed=3)
    with nnrun.LLM(model, page_size=4, max_num_batched_tokens=32) as llm:
        backend = use_flashinfer(llm)
        assert len(backend.groups) == 2
        record_steps(backend, fake.calls)
        llm.generate(prompts, nnrun.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    num_layers = len(backend.layer_to_group)
    starts = [i for i, call in enumerate(fake.calls) if call.kind == "step"]
    assert fake.calls[: starts[0]] == [c for c in fake.calls[: starts[0]] if c.kind == "init"]
    assert len([c for c in fake.calls if c.kind == "init"]) == 4  # a prefill and a decode wrapper per group
    modes = []
    for start, end in zip(starts, starts[1:] + [len(fake.calls)]):
        step = fake.calls[start:end]
        mode = step[0].info["mode"]
        modes.append(mode)
        wrappers = backend.decode_wrappers if mode is ForwardMode.DECODE else backend.prefill_wrappers
        plans = step[1 : 1 + len(backend.groups)]
        assert [(c.kind, c.wrapper) for c in plans] == [("plan", w) for w in wrappers]
        layers = step[1 + len(backend.groups) :]
        expected = []
        for layer_idx in range(num_layers):
            expected += [("forward", None, layer_idx), ("run", wrappers[backend.layer_to_group[layer_idx]], None)]
        assert [(c.kind, c.wrapper, c.info.get("layer")) for c in layers] == expected
    assert ForwardMode.DECODE in modes and ForwardMode.EXTEND in modes


# ---- the backend alone, against the torch backend, on hand-built steps ---------------------------------------

_LAYERS = [  # GQA, a window, a softcap, two scales and a v head dim that differs from the k head dim
    AttentionLayerInfo(0, 4, LayerKVShape(2, 16, 16), 0.25, None, None),
    AttentionLayerInfo(1, 4, LayerKVShape(2, 16, 16), 0.25, 5, 0.5),
    AttentionLayerInfo(2, 4, LayerKVShape(2, 16, 8), 0.125, None, None),
    AttentionLayerInfo(3, 4, LayerKVShape(2, 16, 16), 0.25, None, None),
]
PAGE_SIZE = 4


def _forward_batch(reqs: list[Request], new_lens: list[int], mode: ForwardMode) -> ForwardBatch:
    """A step the way the runner lays it out: each request's last `new_lens[b]` tokens are new."""
    positions, out_cache_loc, kv_slots, starts, prefix_lens = [], [], [], [], []
    for req, new_len in zip(reqs, new_lens):
        prefix = req.num_tokens - new_len
        pages = torch.tensor(req.page_ids)
        slots = pages[torch.arange(req.num_tokens) // PAGE_SIZE] * PAGE_SIZE + torch.arange(req.num_tokens) % PAGE_SIZE
        starts.append(sum(len(p) for p in positions))
        positions.append(torch.arange(prefix, req.num_tokens))
        out_cache_loc.append(slots[prefix:])
        kv_slots.append(slots)
        prefix_lens.append(prefix)
    num_tokens = sum(new_lens)
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


def _run_step(backend, forward_batch, qkv):
    backend.init_forward_metadata(forward_batch)
    outs = []
    for layer, (q, k, v) in zip(_LAYERS, qkv):
        terms = ScoreTerms(layer.scaling, layer.sliding_window, layer.softcap)
        outs.append(backend.forward(layer.layer_idx, q, k, v, terms))
    return outs


def _random_qkv(num_tokens: int, dtype: torch.dtype, generator: torch.Generator):
    return [
        (
            torch.randn(num_tokens, 4, 16, generator=generator).to(dtype),
            torch.randn(num_tokens, 2, 16, generator=generator).to(dtype),
            torch.randn(num_tokens, 2, layer.kv_shape.v_head_dim, generator=generator).to(dtype),
        )
        for layer in _LAYERS
    ]


def _backends(dtype: torch.dtype):
    pools = [KVPool([layer.kv_shape for layer in _LAYERS], 32, PAGE_SIZE, dtype, torch.device("cpu")) for _ in range(2)]
    cpu = torch.device("cpu")
    flashinfer_backend = FlashInferAttnBackend(pools[0], cpu, _LAYERS, workspace_bytes=WORKSPACE_BYTES)
    return flashinfer_backend, TorchAttnBackend(pools[1], cpu)


def _steps_of_three_requests():
    """Yields the ForwardBatch of: a prefill; decodes with a 3-token chunk after a prefix; 3 decodes."""
    reqs = [Request(f"r{i}", [0] * n, nnrun.SamplingParams(max_tokens=1)) for i, n in enumerate([6, 13, 1])]
    for req, pages in zip(reqs, [[31, 7, 14], [3, 30, 12, 9, 20], [0, 25, 26]]):
        req.page_ids = pages  # non-contiguous, partly descending, one spare page
    steps = [([6, 13, 1], ForwardMode.EXTEND), ([1, 3, 1], ForwardMode.EXTEND)] + [([1, 1, 1], ForwardMode.DECODE)] * 3
    for step_index, (new_lens, mode) in enumerate(steps):
        if step_index:
            for req, new_len in zip(reqs, new_lens):
                req.prompt_token_ids = req.prompt_token_ids + [0] * new_len
        yield _forward_batch(reqs, new_lens, mode)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backend_equals_torch_backend_over_extend_mixed_and_decode_steps(fake, dtype, tol):
    flashinfer_backend, torch_backend = _backends(dtype)
    generator = torch.Generator().manual_seed(0)
    for step_index, forward_batch in enumerate(_steps_of_three_requests()):
        qkv = _random_qkv(forward_batch.num_tokens, dtype, generator)
        got = _run_step(flashinfer_backend, forward_batch, qkv)
        want = _run_step(torch_backend, forward_batch, qkv)
        for layer, g, w in zip(_LAYERS, got, want):
            assert g.dtype == w.dtype == dtype and g.shape == w.shape
            assert torch.allclose(g.float(), w.float(), atol=tol, rtol=tol), (step_index, layer.layer_idx)
    runs = [c.wrapper for c in fake.calls if c.kind == "run"]
    # layer 2 (v head dim 8) has no decode kernel and runs the prefill wrapper in decode steps too
    assert runs[-2] is flashinfer_backend.prefill_wrappers[flashinfer_backend.layer_to_group[2]]
    assert runs[-1] is flashinfer_backend.decode_wrappers[flashinfer_backend.layer_to_group[3]]


def test_emulator_reads_the_page_table(fake, monkeypatch):
    """Negative control: pages handed to the kernel in the wrong order change the output."""
    import nnrun.attention.flashinfer_backend as module

    flashinfer_backend, torch_backend = _backends(torch.float32)
    req = Request("r", [0] * 10, nnrun.SamplingParams(max_tokens=1))
    req.page_ids = [5, 9, 2]
    forward_batch = _forward_batch([req], [10], ForwardMode.EXTEND)
    qkv = _random_qkv(10, torch.float32, torch.Generator().manual_seed(1))
    want = _run_step(torch_backend, forward_batch, qkv)
    assert torch.allclose(_run_step(flashinfer_backend, forward_batch, qkv)[0], want[0], atol=1e-5)

    original = module.plan_forward_batch

    def swapped_pages(forward_batch, page_size, chunk_size=None):
        plan = original(forward_batch, page_size, chunk_size)
        plan.kv_indices = plan.kv_indices.flip(0)
        return plan

    monkeypatch.setattr(module, "plan_forward_batch", swapped_pages)
    assert not torch.allclose(_run_step(flashinfer_backend, forward_batch, qkv)[0], want[0], atol=1e-3)


def test_layer_settings_that_differ_from_the_probe_are_refused(fake):
    flashinfer_backend, _ = _backends(torch.float32)
    req = Request("r", [0] * 3, nnrun.SamplingParams(max_tokens=1))
    req.page_ids = [1]
    flashinfer_backend.init_forward_metadata(_forward_batch([req], [3], ForwardMode.EXTEND))
    q, k, v = _random_qkv(3, torch.float32, torch.Generator().manual_seed(2))[1]
    with pytest.raises(RuntimeError, match="layer 1 attends with"):
        flashinfer_backend.forward(1, q, k, v, ScoreTerms(0.25, None, 0.5))  # the probe saw a window of 5


def test_float32_on_cuda_is_refused_before_allocating(fake):
    pool = KVPool([layer.kv_shape for layer in _LAYERS], 2, PAGE_SIZE, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        FlashInferAttnBackend(pool, torch.device("cuda"), _LAYERS)


def test_importing_the_backend_needs_no_flashinfer(monkeypatch):
    import ast
    import inspect

    import nnrun.attention.flashinfer_backend as module

    top_level = ast.parse(inspect.getsource(module)).body
    imported = [alias.name for node in top_level if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module for node in top_level if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "flashinfer"]
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` now raises ImportError
    pool = KVPool([layer.kv_shape for layer in _LAYERS], 2, PAGE_SIZE, torch.float16, torch.device("cpu"))
    with pytest.raises(ImportError):
        FlashInferAttnBackend(pool, torch.device("cpu"), _LAYERS)


# ---- the contract with the real library (skipped where flashinfer is not installed) ------------------------


def _parameters(function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_backend_calls_bind_to_the_real_flashinfer_signatures(monkeypatch):
    """Every __init__/plan/run call the backend makes binds to the installed flashinfer's signatures."""
    real = pytest.importorskip("flashinfer")
    fake = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    flashinfer_backend, _ = _backends(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for forward_batch in _steps_of_three_requests():
        _run_step(flashinfer_backend, forward_batch, _random_qkv(forward_batch.num_tokens, torch.bfloat16, generator))
    seen = set()
    for call in fake.calls:
        real_cls = getattr(real, type(call.wrapper).__name__)
        method = "__init__" if call.kind == "init" else call.kind
        inspect.signature(getattr(real_cls, method)).bind(None, *call.args, **call.kwargs)
        if method == "plan" and hasattr(real_cls, "_plan_impl"):  # decode: plan(**kwargs) forwards to _plan_impl
            inspect.signature(real_cls._plan_impl).bind(None, *call.args, **call.kwargs)
        seen.add((real_cls.__name__, method))
    assert len(seen) == 6  # both wrappers, each constructed, planned and run


@pytest.mark.parametrize("name", ["BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper"])
def test_emulator_signatures_are_the_real_ones(name):
    real_cls = getattr(pytest.importorskip("flashinfer"), name)
    fake_cls = getattr(make_fake_flashinfer(), name)
    for method in ("__init__", "plan", "run"):
        real_method = getattr(real_cls, method)
        if method == "plan" and hasattr(real_cls, "_plan_impl"):
            real_method = real_cls._plan_impl
        assert _parameters(getattr(fake_cls, method)) == _parameters(real_method), (name, method)


def test_a_layers_terms_are_checked_once_and_changed_terms_still_refused(fake, monkeypatch):
    """The check against the probe's plan runs once per layer and terms object (hf_glue keeps a layer's terms)."""
    flashinfer_backend, _ = _backends(torch.float32)
    req = Request("r", [0] * 3, nnrun.SamplingParams(max_tokens=1))
    req.page_ids = [1]
    flashinfer_backend.init_forward_metadata(_forward_batch([req], [3], ForwardMode.EXTEND))
    q, k, v = _random_qkv(3, torch.float32, torch.Generator().manual_seed(2))[1]
    layer = _LAYERS[1]
    checks = []
    check = flashinfer_backend._check_layer_call
    monkeypatch.setattr(flashinfer_backend, "_check_layer_call", lambda *args: checks.append(1) or check(*args))
    planned = ScoreTerms(layer.scaling, layer.sliding_window, layer.softcap)
    for _ in range(3):
        flashinfer_backend.forward(1, q, k, v, planned)
    assert len(checks) == 1
    with pytest.raises(RuntimeError, match="layer 1 attends with"):
        flashinfer_backend.forward(1, q, k, v, ScoreTerms(layer.scaling, None, layer.softcap))


def test_a_large_decode_batch_is_planned_from_its_table_and_matches_hf(fake, monkeypatch):
    """From `TABLE_PLAN_MIN_BATCH` requests, decode steps plan from the request table: the same plan, HF's tokens."""
    import nnrun.attention.flashinfer_backend as module
    import nnrun.attention.flashinfer_plan as plans
    from nnrun.attention.flashinfer_plan import TABLE_PLAN_MIN_BATCH, plan_paged_kv

    planned, from_table = [], []
    original = module.plan_forward_batch
    table_plan = plans.plan_decode_from_table
    monkeypatch.setattr(plans, "plan_decode_from_table", lambda *args: from_table.append(1) or table_plan(*args))

    def compared(forward_batch, page_size, chunk_size=None):
        plan = original(forward_batch, page_size, chunk_size)
        if forward_batch.forward_mode is ForwardMode.DECODE:
            reqs = forward_batch.reqs
            want = plan_paged_kv(forward_batch.prefix_lens, [1] * len(reqs), [r.page_ids for r in reqs], page_size)
            for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
                assert torch.equal(getattr(plan, name), getattr(want, name)), name
            planned.append(forward_batch.batch_size)
        return plan

    monkeypatch.setattr(module, "plan_forward_batch", compared)
    model = make_sharp_model("llama")
    oracle = make_twin(model)
    prompts = random_prompts([3 + i % 11 for i in range(TABLE_PLAN_MIN_BATCH + 2)], seed=6)
    with nnrun.LLM(model, page_size=4) as llm:
        llm.runner.allocator._free_pages.reverse()  # high page ids first: tables run downwards
        use_flashinfer(llm)
        outputs = llm.generate(prompts, nnrun.SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True))
    assert planned and min(planned) >= TABLE_PLAN_MIN_BATCH and len(from_table) == len(planned)
    assert_greedy_matches_hf(oracle, prompts[:6], outputs[:6])
