"""DSA sparse-attention families on the packed path, against plain HF one prompt at a time.

DeepSeek-V3.2, GLM-MoE-DSA, HY-V4 and AXK2 pick each query's top-k keys with an indexer over keys of
its own; on the packed path each request's indexer sees only that request's keys (its cached prefix
and its new tokens, causally), and the paged attention only the picked ones. The tiny configs keep
`index_topk` below every prompt's length, so the picks bind (checked: without them HF's logits
move); a short prompt has fewer keys than the top-k for its first steps. The oracle is HF eager (the
reference path, which HY-V4's attention sinks need).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnrun
from conformance.models import hf_language_model, tiny_tokenizer, twin
from families.tiny import tiny_config
from nnrun import SamplingParams
from nnrun.attention.flashinfer_plan import flashinfer_unplanned_features
from nnrun.forward_batch import ForwardMode, packed_forward_batch
from nnrun.memory import hold_kv
from tolerance import assert_close_packed

SERVED = ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2")
INDEX_TOPK = 4
# 7 and 11 tokens (more keys than the top-k), and 3 (fewer, until its second decode step)
PROMPTS = ([17, 33, 45, 58, 61, 5, 9], [20, 71, 82, 93, 24, 35, 46, 57, 68, 79, 90], [101, 42, 13])
NUM_TOKENS = 5
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def indexed_model(model_type: str, index_topk: int = INDEX_TOPK) -> torch.nn.Module:
    """A tiny fp32 model of the family whose indexer keeps `index_topk` keys per query."""
    config = tiny_config(model_type)
    config.index_topk = index_topk
    config.index_n_heads = 8  # few enough to be fast, enough that a score is rarely an exact ReLU zero (a tie)
    config.index_head_dim = 32
    if getattr(config, "indexer_types", None) is not None:
        config.indexer_types = ["full", "shared"]  # the second layer attends to the first layer's picks
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_oracle(model: torch.nn.Module) -> torch.nn.Module:
    oracle = twin(model)
    oracle.set_attn_implementation("eager")
    return oracle


@torch.no_grad()
def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]  # [T, V]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int = NUM_TOKENS) -> list[int]:
    """Plain HF, this prompt alone, the whole sequence each step (no cache)."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def indexers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Indexer")]


def assert_all_freed(llm) -> None:
    runner = llm.runner
    assert runner.req_to_token_pool.num_free_rows == runner.config.scheduler.max_num_seqs + 1
    runner.allocator.check_no_leaks()


@pytest.mark.parametrize("model_type", SERVED)
def test_family_runs_packed_and_equals_hf_alone(model_type):
    model = indexed_model(model_type)
    oracle = hf_oracle(model)
    dense = hf_oracle(model)
    for indexer in indexers_of(dense):
        indexer.index_topk = 10**6  # every key: the picks must matter, or this test could not fail
    assert (hf_logits(oracle, PROMPTS[1]) - hf_logits(dense, PROMPTS[1])).abs().max() > 1e-3
    expected_tokens = [hf_greedy(oracle, prompt) for prompt in PROMPTS]
    lm = nnrun.LanguageModel(model, max_num_seqs=4, max_model_len=64, page_size=4)
    try:
        runner = lm.engine.runner
        # the load-time probe compared packed with HF and kept the packed path, on the torch backend
        assert runner.exact_forward is None, runner.exact_forward.reason
        assert runner.attn_backend.name == "torch" and all(layer.has_key_indices for layer in runner.layers)
        saved = []
        with lm.trace() as tracer:
            for prompt in PROMPTS:
                with tracer.invoke(list(prompt)):
                    saved.append(lm.output.logits.save())
        for prompt, logits in zip(PROMPTS, saved):
            assert_close_packed(logits[0], hf_logits(oracle, prompt), msg=f"{model_type}, {len(prompt)} tokens")
        with lm.engine.paused():  # all three in the same steps: one packed prefill, then batched decodes
            handles = [lm.engine.submit(list(prompt), GREEDY) for prompt in PROMPTS]
        assert [list(h.result().outputs[0].token_ids) for h in handles] == expected_tokens
        assert_all_freed(lm.engine)
        # Called plainly, outside a step, the loaded model still attends to its picks only (as HF's sdpa).
        assert_close_packed(hf_logits(model, PROMPTS[1]), hf_logits(oracle, PROMPTS[1]), msg="a plain call")
    finally:
        lm.shutdown()


def test_a_packed_dsa_model_takes_no_decode_graphs():
    """A graph's forward does not serve the indexers their step's layout: such a model decodes eagerly, and a
    capturer given to it captures nothing (the CPU's lazy capture failed on it, logging a warning)."""
    from fake_cuda_graph import RecordingCapturer

    with nnrun.LLM(indexed_model("deepseek_v32"), max_num_seqs=4, max_model_len=64, page_size=4) as llm:
        runner = llm.runner
        assert runner.path.indexer_keys is not None and not runner.path.takes_graphs
        capturer = RecordingCapturer()
        runner.init_cuda_graphs(capturer=capturer)
        assert runner.graph_runner is None and capturer.captures == 0
        llm.generate([list(PROMPTS[0])], GREEDY)  # on CPU too: no lazy capture is tried
        assert runner.graph_runner is None


def test_a_request_joining_mid_generation_equals_it_alone():
    """The joining step mixes decodes of different prefixes with new prefills: each picks from its own keys."""
    model = indexed_model("deepseek_v32")
    expected = [hf_greedy(hf_oracle(model), prompt) for prompt in PROMPTS]
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64, page_size=4) as llm:
        first = [llm.make_request_from_ids(list(p), GREEDY) for p in PROMPTS[:2]]
        late = [llm.make_request_from_ids(list(p), GREEDY) for p in PROMPTS[2:]]
        for req in first:
            llm.core.add_request(req)
        for _ in range(2):  # a prefill, then a decode step
            llm.core.step()
        for req in late:
            llm.core.add_request(req)
        for _ in range(50):
            if not llm.core.has_unfinished:
                break
            llm.core.step()
        assert [req.output_token_ids for req in first + late] == expected
        assert_all_freed(llm)


def test_several_new_tokens_after_a_cached_prefix_pick_from_prefix_and_new_keys():
    """A chunk after a cached prefix: its indexer keys come from the pool and the chunk, causally."""
    model = indexed_model("glm_moe_dsa")
    oracle = hf_oracle(model)
    prompt, more = list(PROMPTS[1][:6]), list(PROMPTS[1][6:])
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64, page_size=4) as llm:
        runner = llm.runner
        with runner.step_lock, runner._transient_requests([prompt, list(PROMPTS[0])]) as reqs:
            req_to_token, page_size = runner.req_to_token_pool.req_to_token, runner.allocator.page_size
            runner.forward(packed_forward_batch(reqs, ForwardMode.EXTEND, req_to_token, page_size, [False, False]))
            for req in reqs:
                req.num_computed_tokens = req.num_tokens
            reqs[0].output_token_ids.extend(more)  # 5 new tokens after a 6-token prefix, beside a decode
            reqs[1].output_token_ids.append(3)
            for req in reqs:
                assert hold_kv(req, req.num_tokens, runner.allocator, runner.req_to_token_pool)
            batch = packed_forward_batch(reqs, ForwardMode.EXTEND, req_to_token, page_size, [True, False])
            output = runner.forward(batch)
        got = torch.cat([output.prompt_logits[0], output.next_token_logits[:1]])  # the chunk's 5 positions
        assert_close_packed(got, hf_logits(oracle, prompt + more)[len(prompt) :], msg="chunk after a prefix")
        assert_close_packed(output.next_token_logits[1], hf_logits(oracle, list(PROMPTS[0]) + [3])[-1], msg="decode")


def test_deepseek_v4_stays_on_the_exact_path_and_says_why():
    """Its indexer scores compressed key blocks with compressor state between forwards: not a DSA indexer."""
    config = tiny_config("deepseek_v4")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with nnrun.LLM(model, max_num_seqs=2, max_model_len=32, page_size=4) as llm:
        reason = llm.runner.exact_forward.reason
    assert reason.startswith("DeepseekV4Indexer is a sparse-attention indexer") and "compressed key blocks" in reason


def test_the_exact_path_asked_for_runs_a_dsa_model_with_hf_own_cache():
    model = indexed_model("hy_v4")
    expected = [hf_greedy(hf_oracle(model), prompt) for prompt in PROMPTS]
    with nnrun.LLM(model, forward_path="exact", max_num_seqs=4, max_model_len=64, page_size=4) as llm:
        assert llm.runner.exact_forward is not None and llm.runner.indexer_keys is None
        assert [list(o.outputs[0].token_ids) for o in llm.generate([list(p) for p in PROMPTS], GREEDY)] == expected


def test_flashinfer_leaves_layers_attending_to_picks_to_the_torch_backend():
    from nnrun.memory import LayerKVShape
    from nnrun.model_probe import AttentionLayerInfo

    shape = LayerKVShape(num_kv_heads=4, head_dim=64, v_head_dim=64)
    layer = AttentionLayerInfo(0, 4, shape, 0.125, None, None, has_key_indices=True)
    assert "sparse-attention indexer" in flashinfer_unplanned_features([layer], 16)
    assert flashinfer_unplanned_features([AttentionLayerInfo(0, 4, shape, 0.125, None, None)], 16) is None


# ---- nnsight: each invoke's picks and attention are its own --------------------------------------


@pytest.fixture(scope="module")
def dsa_pair():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = indexed_model("deepseek_v32")
        plain = hf_oracle(model)
        oracle = hf_language_model(hf_oracle(model), tiny_tokenizer())
        lm = nnrun.LanguageModel(model, tokenizer=tiny_tokenizer(), max_num_seqs=4, max_model_len=64, page_size=4)
    yield lm, oracle, plain
    lm.shutdown()


def read_layer(model, layer: int) -> tuple:
    attention = model.model.layers[layer].self_attn
    return attention.indexer.output.save(), attention.output[0].save(), model.output.logits.save()


def test_each_invoke_reads_its_own_picks_and_attention_as_nnsight_on_hf(dsa_pair):
    lm, oracle, _ = dsa_pair
    short, long = list(PROMPTS[0]), list(PROMPTS[1])
    ours, theirs = [], []
    with lm.trace() as tracer:
        with tracer.invoke(short):
            ours.append(read_layer(lm, 1))
        with tracer.invoke(long):
            ours.append(read_layer(lm, 1))
    for prompt in (short, long):
        with oracle.trace(torch.tensor([prompt])):  # nnsight on HF, this prompt alone
            theirs.append(read_layer(oracle, 1))
    for prompt, packed, alone in zip((short, long), ours, theirs):
        assert torch.equal(packed[0], alone[0]), f"{len(prompt)} tokens: the indexer's picks"
        assert_close_packed(packed[1], alone[1], msg=f"{len(prompt)} tokens: attention output")
        assert_close_packed(packed[2], alone[2], msg=f"{len(prompt)} tokens: logits")


def test_sparse_attention_probabilities_equal_hf_eager(dsa_pair):
    lm, _, plain = dsa_pair
    prompt = list(PROMPTS[1])
    with torch.no_grad():
        expected = plain(torch.tensor([prompt]), output_attentions=True).attentions  # [1, H, T, T] per layer
    causal = torch.ones((len(prompt), len(prompt)), dtype=torch.bool).tril()
    with lm.trace(prompt, output_attentions=True):
        got = list().save()
        for layer in lm.model.layers:
            got.append(layer.self_attn.output[1])
    for layer, (want, have) in enumerate(zip(expected, got)):
        assert (want[..., causal] == 0).any(), "the picks leave some causal keys out"
        assert_close_packed(have, want, msg=f"layer {layer}")


def test_a_hook_inside_an_indexer_is_refused_by_name():
    model = indexed_model("deepseek_v32")
    with nnrun.LLM(model, max_num_seqs=4, max_model_len=64, page_size=4) as llm:
        handle = indexers_of(model)[0].wk.register_forward_hook(lambda *args: None)
        try:
            with pytest.raises(RuntimeError, match="once per group of requests"):
                llm.runner.run_prefill_only([list(p) for p in PROMPTS])
        finally:
            handle.remove()
        llm.runner.run_prefill_only([list(p) for p in PROMPTS])  # without it, the same forward runs
        assert_all_freed(llm)
