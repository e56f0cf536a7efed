"""KV pool sizing on a GPU: the arithmetic, the profiled steps, and the profiling run itself on CPU
(with torch.cuda's memory counters standing in, since this machine has no GPU)."""

from __future__ import annotations

import pytest
import torch

import nnrun
from model_zoo import make_model
from nnrun.kv_sizing import GiB, kv_budget_bytes, profile_prompt_lengths


def test_budget_is_the_engines_share_less_what_is_in_use_and_the_activations():
    # 80 GiB card, 20 GiB in use, 0.9 of it allowed, 4 GiB of activations: 72 - 20 - 4 = 48 GiB
    assert kv_budget_bytes(80 * GiB, 60 * GiB, 0.9, 4 * GiB) == 48 * GiB


def test_no_room_for_the_kv_cache_names_the_option_to_change():
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5.*no room is left for the KV cache"):
        kv_budget_bytes(80 * GiB, 40 * GiB, 0.5, 1 * GiB)


def test_profiled_step_fills_the_token_budget_with_the_most_requests_and_the_longest_prompts():
    lengths = profile_prompt_lengths(8192, 4096, 256)
    assert len(lengths) == 256 and sum(lengths) == 8192
    assert lengths[:3] == [4096, 3842, 1]  # 8192 - 256 spare tokens: 4095 to the first, 3841 to the second
    assert profile_prompt_lengths(10, 100, 256) == [1] * 10


def test_profiling_runs_the_largest_steps_on_a_throwaway_pool_and_frees_it(monkeypatch):
    """The CUDA path on CPU: memory counters faked, the dummy steps real."""
    counters = {"allocated": 1000, "peak": 1000}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: counters.update(peak=1000))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["peak"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with nnrun.LLM(make_model("llama"), max_num_batched_tokens=40, max_num_seqs=6, max_model_len=64) as llm:
        runner = llm.runner
        own_cache = runner.kv_pool, runner.allocator, runner.req_to_token_pool
        steps = runner.profile_steps()
        assert steps == [[35, 1, 1, 1, 1, 1], [64]]  # 64 > 40: the longest prompt runs in a step of its own
        seen_tokens = []
        hook = runner.model.model.layers[0].register_forward_hook(lambda m, i, o: seen_tokens.append(o.shape[1]))
        runner.run_model = _peaking(runner.run_model, counters)
        try:
            assert runner.profile_activation_peak() == 5000
        finally:
            hook.remove()
            del runner.run_model
        assert seen_tokens == [40, 64]
        assert runner.kv_pool is None and runner.attn_backend is None
        runner.kv_pool, runner.allocator, runner.req_to_token_pool = own_cache  # the engine's own pool back
        runner.init_attention_backend()
        out = llm.generate([[5, 6, 7]], nnrun.SamplingParams(max_tokens=2, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 2


def _peaking(run_model, counters):
    def run(forward_batch):
        counters["peak"] = max(counters["peak"], 6000)
        return run_model(forward_batch)

    return run
