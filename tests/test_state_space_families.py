"""State-space and hybrid families on the packed path, over the state pool, against plain HF one prompt at a time.

Each request's mixer layers run HF's own code on that request's tokens and state: packed prefills of
different lengths share no state, decodes run batched, a request joining mid-generation or
recomputed after preemption comes out as it would alone, and every state row is back in the pool
when the requests end, however they end.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import nnrun
from conformance.models import twin
from families.sweep import check_family
from families.tiny import tiny_config, tiny_model
from nnrun import SamplingParams
from tolerance import assert_close_packed

# Pure state-space models, then hybrids of mixers and attention (and LFM2's short conv).
SERVED = (
    "mamba",
    "mamba2",
    "falcon_mamba",
    "jamba",
    "qwen3_next",
    "qwen3_5_text",
    "lfm2",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    "kimi_linear",
    "olmo_hybrid",
    "minimax",
    "bamba",
    "recurrent_gemma",
    "zaya",
    "zamba2",
    "rwkv",
    "xlstm",
)
# A pure state-space model, a linear-attention hybrid and a short-conv hybrid: the lifecycle tests' subjects.
LIFECYCLE = ("mamba", "qwen3_next", "lfm2")
# Families with ways of their own: MiniMax's cache API (`MiniMaxCache`), Bamba's positions after a cache (from 0
# unless given), RecurrentGemma's states kept on its recurrent blocks, Zaya's convolution inside attention (its
# CCA projection, called with positional arguments, returns query, key and value per token), Zamba2's attention
# blocks told their layer by argument, RWKV's whole-model state columns (its decodes one request at a time),
# xLSTM's states returned by its blocks (and its logits never cut to the rows asked for).
OWN_WAYS = ("minimax", "bamba", "recurrent_gemma", "zaya", "zamba2", "rwkv", "xlstm")
PROMPTS = ([17, 33, 45, 58, 61], [20, 71, 82, 93, 24, 35, 46, 57, 68, 79, 90], [101, 42, 13], [7, 8, 9, 10, 11, 12, 13])
NUM_TOKENS = 5
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
MIXER_REL = 1e-4  # the decode batch sums a request's products in other matmul shapes than HF alone


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int = NUM_TOKENS) -> list[int]:
    """Plain HF, this prompt alone, the whole sequence each step (no cache)."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]  # [T, V]


def tokens_of(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def assert_all_rows_free(llm: nnrun.LLM) -> None:
    runner = llm.runner
    assert runner.req_to_token_pool.num_free_rows == runner.config.scheduler.max_num_seqs + 1
    runner.allocator.check_no_leaks()


@pytest.mark.parametrize("model_type", SERVED)
def test_family_runs_packed_and_equals_hf(model_type):
    result = check_family(model_type)  # a packed trace of 3 prompts and greedy generation, against HF
    assert result.path == "packed", result.detail


@pytest.mark.parametrize("model_type", LIFECYCLE + OWN_WAYS)
def test_packed_prefills_and_batched_decodes_equal_each_prompt_alone(model_type):
    model = tiny_model(model_type)
    oracle = twin(model)
    expected_tokens = [hf_greedy(oracle, prompt) for prompt in PROMPTS]
    lm = nnrun.LanguageModel(model, max_num_seqs=4, max_model_len=64)
    try:
        runner = lm.engine.runner
        assert runner.exact_forward is None and runner.state_pool is not None
        saved = []
        with lm.trace() as tracer:
            for prompt in PROMPTS:
                with tracer.invoke(list(prompt)):
                    saved.append(lm.output.logits.save())
        for prompt, logits in zip(PROMPTS, saved):
            assert_close_packed(logits[0], hf_logits(oracle, prompt), rel=MIXER_REL, msg=f"{len(prompt)} tokens")
        forwards_before = lm.engine.step_counters()["forwards"]
        with lm.engine.paused():  # all four in the same steps: one packed prefill, then batched decodes
            handles = [lm.engine.submit(list(prompt), GREEDY) for prompt in PROMPTS]
        assert [list(h.result().outputs[0].token_ids) for h in handles] == expected_tokens
        assert lm.engine.step_counters()["forwards"] - forwards_before == NUM_TOKENS
        assert_all_rows_free(lm.engine)
    finally:
        lm.shutdown()


def test_zamba2s_attention_blocks_told_their_layer_page_a_kv_cache_each():
    """Zamba2's hybrid layers share one block's weights, each block module HF's `layer_idx = -1`, told its layer."""
    from transformers import AutoModelForCausalLM

    from nnrun.state.placeholders import StateLayerPlaceholder

    config = tiny_config("zamba2")
    config.layers_block_type = ["linear_attention", "hybrid", "hybrid"]
    config.hybrid_layer_ids, config.num_hidden_layers = [1, 2], 3
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    oracle = twin(model)
    blocks = [model.model.layers[i].shared_transformer for i in (1, 2)]
    assert blocks[0].self_attn.q_proj.weight is blocks[1].self_attn.q_proj.weight
    expected = [hf_greedy(oracle, prompt) for prompt in PROMPTS]
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64) as llm:
        assert llm.runner.exact_forward is None
        attention = [layer.layer_idx for layer in llm.runner.layers if not isinstance(layer, StateLayerPlaceholder)]
        assert attention == [1, 2]
        assert tokens_of(llm.generate([list(p) for p in PROMPTS], GREEDY)) == expected
    assert all(block.self_attn.layer_idx == -1 for block in blocks)  # HF's again outside a call


def test_a_state_model_on_the_exact_path_numbers_the_tokens_after_its_cache():
    """Bamba's forward numbers the tokens after its cache from 0 unless told (HF's generate tells it): so do we."""
    model = tiny_model("bamba")
    oracle = twin(model)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64, forward_path="exact") as llm:
        assert llm.runner.exact_forward is not None
        outputs = [output.outputs[0] for output in llm.generate([list(p) for p in PROMPTS], params)]
    for prompt, output in zip(PROMPTS, outputs):
        assert list(output.token_ids) == hf_greedy(oracle, prompt)
        ids = list(prompt) + list(output.token_ids)
        expected = hf_logits(oracle, ids).log_softmax(-1)[len(prompt) - 1 : -1]  # [NUM_TOKENS, V]
        expected = expected.gather(1, torch.tensor(output.token_ids)[:, None])[:, 0]
        actual = torch.tensor([step[token] for step, token in zip(output.logprobs, output.token_ids)])
        assert_close_packed(actual, expected, msg=f"{len(prompt)} tokens")  # HF itself: summation order only


@pytest.mark.parametrize("model_type", LIFECYCLE)
def test_a_request_joining_mid_generation_equals_it_alone(model_type):
    model = tiny_model(model_type)
    expected = [hf_greedy(twin(model), prompt) for prompt in PROMPTS]
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64) as llm:
        first = [llm.make_request_from_ids(list(p), GREEDY) for p in PROMPTS[:2]]
        late = [llm.make_request_from_ids(list(p), GREEDY) for p in PROMPTS[2:]]
        for req in first:
            llm.core.add_request(req)
        for _ in range(2):  # a prefill, then a decode step
            llm.core.step()
        for req in late:  # they prefill in a step where the first two decode over their states
            llm.core.add_request(req)
        for _ in range(50):
            if not llm.core.has_unfinished:
                break
            llm.core.step()
        assert [req.output_token_ids for req in first + late] == expected
        assert_all_rows_free(llm)


@pytest.mark.parametrize("model_type", LIFECYCLE)
def test_preempted_requests_recompute_their_state_and_give_the_same_tokens(model_type):
    model = tiny_model(model_type)
    prompts = [list(p) + list(p) for p in PROMPTS]  # 10 to 22 tokens
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [hf_greedy(twin(model), prompt, 12) for prompt in prompts]
    # 4 running requests of up to 34 tokens need ~130 slots; 72 forces preemption.
    with nnrun.LLM(model, page_size=4, max_total_tokens=72, max_num_seqs=4, max_model_len=64) as llm:
        assert tokens_of(llm.generate(prompts, params)) == expected
        assert llm.core.scheduler.num_preemptions > 0
        assert_all_rows_free(llm)


def test_aborted_and_finished_requests_give_their_rows_back():
    model = tiny_model("mamba")
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64) as llm:
        reqs = [llm.make_request_from_ids(list(p), GREEDY) for p in PROMPTS]
        for req in reqs:
            llm.core.add_request(req)
        llm.core.step()
        assert llm.runner.req_to_token_pool.num_free_rows == 1  # 4 running requests, one spare row
        llm.core.abort_requests({reqs[0].request_id: RuntimeError("aborted"), reqs[3].request_id: RuntimeError("x")})
        assert llm.runner.req_to_token_pool.num_free_rows == 3
        while llm.core.has_unfinished:
            llm.core.step()
        assert_all_rows_free(llm)


def test_a_forward_that_fails_leaves_every_state_as_it_was():
    """A step that raises is run again (or its requests end): no mixer layer may have advanced a state."""
    model = tiny_model("qwen3_next")
    expected = [hf_greedy(twin(model), prompt) for prompt in PROMPTS[:2]]
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64) as llm:
        reqs = [llm.make_request_from_ids(list(p), GREEDY) for p in PROMPTS[:2]]
        for req in reqs:
            llm.core.add_request(req)
        llm.core.step()
        pool = llm.runner.state_pool
        before = {key: tensor.clone() for key, tensor in pool.tensors.items()}
        counts = list(pool.num_tokens)
        last_layer = model.model.layers[-1]
        handle = last_layer.register_forward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
        batch = llm.runner.prepare_forward_batch_decode(reqs)
        with pytest.raises(RuntimeError, match="boom"):
            llm.runner.forward(batch)
        handle.remove()
        assert pool.num_tokens == counts
        assert all(torch.equal(before[key], tensor) for key, tensor in pool.tensors.items())
        while llm.core.has_unfinished:  # the same decode step again, and on to the end
            llm.core.step()
        assert [req.output_token_ids for req in reqs] == expected


# ---- nnsight: a mixer's output is each invoke's own ---------------------------------------
SHORT, LONG = PROMPTS[2], PROMPTS[1]


@torch.no_grad()
def hf_mixer_alone(oracle: torch.nn.Module, prompt: list[int], zero_output: bool = False) -> dict:
    """Plain HF on one prompt: layer 0's mixer output (zeroed, if asked, before the layers after it) and the logits."""
    seen = {}

    def hook(module, args, output):
        seen["mixer"] = output.clone()
        return torch.zeros_like(output) if zero_output else None

    handle = oracle.backbone.layers[0].mixer.register_forward_hook(hook)
    try:
        seen["logits"] = hf_logits(oracle, prompt)
    finally:
        handle.remove()
    return seen


@pytest.fixture(scope="module")
def mamba_lm():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("mamba")
        oracle = twin(model)
        lm = nnrun.LanguageModel(model, max_num_seqs=4, max_model_len=64)
    yield lm, oracle
    lm.shutdown()


def test_each_invoke_reads_its_own_mixer_output(mamba_lm):
    lm, oracle = mamba_lm
    with lm.trace() as tracer:
        with tracer.invoke(list(SHORT)):
            short_mixer = lm.backbone.layers[0].mixer.output.save()
        with tracer.invoke(list(LONG)):
            long_mixer = lm.backbone.layers[0].mixer.output.save()
    assert_close_packed(short_mixer, hf_mixer_alone(oracle, SHORT)["mixer"], rel=MIXER_REL, msg="short")
    assert_close_packed(long_mixer, hf_mixer_alone(oracle, LONG)["mixer"], rel=MIXER_REL, msg="long")


def test_a_write_to_one_invokes_mixer_output_touches_only_that_request(mamba_lm):
    lm, oracle = mamba_lm
    with lm.trace() as tracer:
        with tracer.invoke(list(SHORT)):
            lm.backbone.layers[0].mixer.output[:] = 0
            short_logits = lm.output.logits.save()
        with tracer.invoke(list(LONG)):
            long_logits = lm.output.logits.save()
    assert_close_packed(short_logits[0], hf_mixer_alone(oracle, SHORT, zero_output=True)["logits"], rel=MIXER_REL)
    assert_close_packed(long_logits[0], hf_mixer_alone(oracle, LONG)["logits"], rel=MIXER_REL)


def test_a_read_inside_a_mixer_is_refused_never_served_another_requests_values(mamba_lm):
    """The mixer's own modules run once per request, not on the step's `[1, N, ...]`: nobody is served them."""
    lm, _ = mamba_lm
    with pytest.raises(Exception, match="in_proj"):
        with lm.trace() as tracer:
            with tracer.invoke(list(SHORT)):
                lm.backbone.layers[0].mixer.in_proj.output.save()
            with tracer.invoke(list(LONG)):
                lm.backbone.layers[0].mixer.in_proj.output.save()


def test_a_torch_hook_inside_a_mixer_is_refused_by_name():
    model = tiny_model("mamba")
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64) as llm:
        handle = model.backbone.layers[0].mixer.in_proj.register_forward_hook(lambda *args: None)
        try:
            with pytest.raises(RuntimeError, match="once per request"):
                llm.runner.run_prefill_only([list(SHORT), list(LONG)])
        finally:
            handle.remove()
        llm.runner.run_prefill_only([list(SHORT), list(LONG)])  # without it, the same forward runs
        assert_all_rows_free(llm)


@pytest.mark.parametrize("model_type", ("mamba", "qwen3_next"))
def test_several_new_tokens_after_a_cached_prefix_continue_the_state(model_type):
    """No scheduler step brings more than one token after a prefix today; the mixers still continue correctly."""
    from nnrun.forward_batch import ForwardMode, packed_forward_batch
    from nnrun.memory import hold_kv

    model = tiny_model(model_type)
    oracle = twin(model)
    prompt, more = list(LONG[:6]), list(LONG[6:])
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64) as llm:
        runner = llm.runner
        with runner.step_lock, runner._transient_requests([prompt, list(SHORT)]) as reqs:
            first = packed_forward_batch(
                reqs, ForwardMode.EXTEND, runner.req_to_token_pool.req_to_token, runner.allocator.page_size, [0, 0]
            )
            runner.forward(first)
            for req in reqs:
                req.num_computed_tokens = req.num_tokens
            reqs[0].output_token_ids.extend(more)  # 5 new tokens after a 6-token prefix
            reqs[1].output_token_ids.append(7)  # a decode beside it
            for req in reqs:
                assert hold_kv(req, req.num_tokens, runner.allocator, runner.req_to_token_pool)
            second = packed_forward_batch(
                reqs, ForwardMode.EXTEND, runner.req_to_token_pool.req_to_token, runner.allocator.page_size, [1, 0]
            )
            output = runner.forward(second)
        expected = hf_logits(oracle, prompt + more)
        assert_close_packed(output.prompt_logits[0], expected[6:-1], rel=MIXER_REL)
        assert_close_packed(output.next_token_logits[0], expected[-1], rel=MIXER_REL)
        assert_close_packed(output.next_token_logits[1], hf_logits(oracle, list(SHORT) + [7])[-1], rel=MIXER_REL)
        assert_all_rows_free(llm)


def test_calling_a_mixer_again_within_a_step_leaves_every_state_as_hf_would():
    """A second call (intervention code calling the module itself) runs as HF runs a call given no cache."""
    model = tiny_model("mamba")
    oracle = twin(model)
    calling = []

    def call_again(module, args, kwargs, output):
        if not calling:  # the hook's own call does not call again
            calling.append(True)
            module(args[0] * 2 if args else kwargs["hidden_states"] * 2)  # its output is dropped
            calling.pop()

    handles = [m.backbone.layers[0].mixer.register_forward_hook(call_again, with_kwargs=True) for m in (model, oracle)]
    try:
        with torch.no_grad():
            hf_cache = oracle(input_ids=torch.tensor([list(LONG)]), use_cache=True).cache_params
        with nnrun.LLM(model, max_num_seqs=4, max_model_len=64) as llm:
            llm.runner.run_prefill_only([list(SHORT), list(LONG)])
            row = 1  # the second transient request's table row
            for kind in ("conv", "recurrent"):
                ours = llm.runner.state_pool.tensors[(0, kind, 0)][row]
                theirs = getattr(hf_cache.layers[0], f"{kind}_states")[0][0]
                assert_close_packed(ours, theirs, rel=MIXER_REL, msg=kind)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("model_type", ("qwen3_next", "nemotron_h"))
def test_a_hybrid_on_the_flashinfer_backend_plans_its_kv_free_layers_with_an_attention_layer(monkeypatch, model_type):
    """KV-free layers between attention layers hold no KV pages, and FlashInfer's plan groups still cover every index."""
    import sys

    from fake_flashinfer import make_fake_flashinfer
    from nnrun.attention.flashinfer_backend import FlashInferAttnBackend
    from nnrun.state.placeholders import StateLayerPlaceholder

    fake = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    model = tiny_model(model_type)
    expected = [hf_greedy(twin(model), prompt) for prompt in PROMPTS]
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64) as llm:
        runner = llm.runner
        placeholders = [layer.layer_idx for layer in runner.layers if isinstance(layer, StateLayerPlaceholder)]
        assert placeholders and all(runner.kv_pool.k_pages[i].numel() == 0 for i in placeholders)
        runner.attn_backend = FlashInferAttnBackend(
            runner.kv_pool, runner.device, runner.layers, workspace_bytes=1 << 16
        )
        assert tokens_of(llm.generate([list(p) for p in PROMPTS], GREEDY)) == expected
    assert any(call.kind == "run" for call in fake.calls)


def test_gradients_flow_through_each_invokes_mixer(mamba_lm):
    """A trace's backward reaches a mixer's output through the per-request calls, as on plain HF."""
    lm, oracle = mamba_lm
    with lm.trace() as tracer:
        with tracer.invoke(list(SHORT)):
            mixer = lm.backbone.layers[0].mixer.output.save()
            mixer.retain_grad()
            logits = lm.lm_head.output
            (logits[0, -1].logsumexp(-1) - logits[0, -1, 0]).backward()
        with tracer.invoke(list(LONG)):
            lm.output.logits.save()
    seen = {}

    def keep(module, args, output):
        output.retain_grad()
        seen["mixer"] = output

    handle = oracle.backbone.layers[0].mixer.register_forward_hook(keep)
    try:
        logits = oracle(input_ids=torch.tensor([list(SHORT)]), use_cache=False).logits
        (logits[0, -1].logsumexp(-1) - logits[0, -1, 0]).backward()
    finally:
        handle.remove()
    assert mixer.grad is not None
    assert_close_packed(mixer.grad, seen["mixer"].grad, rel=MIXER_REL)
