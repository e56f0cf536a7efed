"""Decode CUDA graphs on CPU: the real graph runner and FlashInfer backend, a recording stand-in for
CUDA's capture (tests/fake_cuda_graph.py) and the FlashInfer emulator in its graph mode.

The stand-in replays the captured aten ops on the captured tensors without running Python, as a
GPU replays kernels, and refuses host syncs during capture. So these tests check on CPU what a GPU
would get wrong: stale static buffers, padding rows, values frozen at capture, page tables planned
into the buffers the graph reads, and which steps may replay at all.
"""

from __future__ import annotations

import sys

import pytest
import torch

import nnrun
from fake_cuda_graph import HostSyncDuringCapture, RecordingCapturer
from fake_flashinfer import make_fake_flashinfer
from model_zoo import hf_logits, make_twin, random_prompts
from nnrun.attention.flashinfer_plan import pad_decode_plan, plan_paged_kv
from nnrun.config import DeviceConfig
from nnrun.cuda_graph import default_batch_sizes
from nnrun.forward_batch import ForwardMode
from test_flashinfer_emulated import FAMILIES, TOL, make_sharp_model, use_flashinfer

GRAPH_SIZES = [1, 2, 4, 8]


@pytest.fixture
def fake(monkeypatch):
    module = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def capture_graphs(llm: nnrun.LLM, sizes=GRAPH_SIZES) -> RecordingCapturer:
    use_flashinfer(llm)
    llm.runner.config.device.cuda_graph_batch_sizes = sizes
    capturer = RecordingCapturer()
    llm.runner.init_cuda_graphs(capturer=capturer)
    return capturer


def count_decode_steps(llm: nnrun.LLM) -> dict:
    """How many decode steps replayed a graph and how many ran eagerly (read off the step, not asked before it)."""
    runner, counts = llm.runner, {"replayed": 0, "eager": 0}
    run_model = runner.run_model

    def counting_run_model(forward_batch):
        if forward_batch.forward_mode is not ForwardMode.DECODE:
            return run_model(forward_batch)
        graphs = runner.graph_runner
        before = None if graphs is None else graphs.num_replays
        output = run_model(forward_batch)
        counts["eager" if graphs is None or graphs.num_replays == before else "replayed"] += 1
        return output

    runner.run_model = counting_run_model
    return counts


def count_replays(llm: nnrun.LLM) -> dict:
    """Counts (`count`) the decode steps that replayed a whole-step graph."""
    counts = {"count": 0}
    graphs = llm.runner.graph_runner
    if graphs is not None:
        replay = graphs.replay

        def counting(forward_batch):
            counts["count"] += 1
            return replay(forward_batch)

        graphs.replay = counting
    return counts


def greedy_params(max_tokens: int) -> nnrun.SamplingParams:
    return nnrun.SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True)


# ---- the stand-in itself -------------------------------------------------------------------------
def test_recording_capturer_replays_ops_on_the_captured_tensors():
    static_in, weight = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    replay, out = RecordingCapturer().capture(lambda: static_in * 2 + weight)
    static_in.copy_(torch.tensor([10.0, 20.0, 30.0]))
    replay()
    assert torch.equal(out, torch.tensor([21.0, 42.0, 63.0]))


def test_recording_capturer_freezes_python_values_like_a_gpu_graph():
    """Negative control: code that reads a Python value per call is wrong under graphs, and stays wrong here."""
    scale = {"value": 2.0}
    static_in = torch.ones(2)
    replay, out = RecordingCapturer().capture(lambda: static_in * scale["value"])
    scale["value"] = 5.0
    replay()
    assert torch.equal(out, torch.full((2,), 2.0))


def test_recording_capturer_refuses_host_syncs():
    static_in = torch.ones(2)
    with pytest.raises(HostSyncDuringCapture):
        RecordingCapturer().capture(lambda: static_in * (2.0 if bool(static_in.sum() > 0) else 3.0))


# ---- planning and sizes --------------------------------------------------------------------------
def test_pad_decode_plan_points_padding_rows_at_the_trash_page():
    plan = plan_paged_kv([5, 2], [1, 1], [[7, 3], [4]], page_size=4)
    padded = pad_decode_plan(plan, 4, trash_page=9)
    assert padded.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert padded.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert padded.kv_indices.tolist() == [7, 3, 4, 9, 9]
    assert padded.kv_last_page_len.tolist() == [2, 3, 1, 1]
    assert padded.seq_lens().tolist() == [6, 3, 1, 1]
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_plan(plan, 1, trash_page=9)


def test_default_batch_sizes_cover_every_batch_up_to_max_num_seqs():
    assert default_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and default_batch_sizes(256)[-1] == 256
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(1000)[-1] == 256
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        DeviceConfig(cuda_graph_batch_sizes=[0, 4])


def test_the_torch_backend_captures_no_graphs():
    with nnrun.LLM(make_sharp_model("llama")) as llm:
        llm.runner.init_cuda_graphs(capturer=RecordingCapturer())
        assert llm.runner.graph_runner is None


# ---- replay against HF ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_decode_matches_hf_as_the_batch_shrinks(fake, family):
    """Six requests ending at different lengths: batches 6, 5, ... replay the graphs of 8, 4, 2 and 1,
    so padding rows follow real rows that an earlier, larger batch left in the static buffers."""
    model = make_sharp_model(family)
    oracle = make_twin(model)
    prompts = random_prompts([3, 17, 9, 1, 30, 12], seed=7)
    lengths = [2, 9, 4, 7, 12, 5]
    with nnrun.LLM(model, page_size=4) as llm:
        capturer = capture_graphs(llm)
        counts = count_decode_steps(llm)
        calls_before = len(fake.calls)
        outputs = llm.generate(prompts, [greedy_params(n) for n in lengths])
        llm.runner.allocator.check_no_leaks()
    assert capturer.captures == len(GRAPH_SIZES)
    assert counts["replayed"] == capturer.replays == max(lengths) - 1 and counts["eager"] == 0
    graph_runs = [
        call
        for call in fake.calls[calls_before:]
        if call.kind == "run" and getattr(call.wrapper, "use_cuda_graph", False)
    ]
    assert graph_runs == [], "a replay ran the attention wrapper's Python"
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        expected = torch.log_softmax(hf_logits(oracle, prompt + completion.token_ids), dim=-1)  # [T, V]
        for i, token in enumerate(completion.token_ids):
            position = len(prompt) - 1 + i
            assert token == expected[position].argmax().item(), family
            assert abs(completion.logprobs[i][token] - expected[position, token].item()) < TOL, family


def test_replay_equals_eager_decode_on_a_sampled_run(fake):
    """Seeded sampling: the same tokens and logprobs with graphs as without them."""
    model = make_sharp_model("qwen2")
    prompts = random_prompts([4, 11, 6], seed=2)
    params = [
        nnrun.SamplingParams(max_tokens=6, temperature=1.0, seed=i, logprobs=0, ignore_eos=True) for i in range(3)
    ]
    results = []
    for graphs in (False, True):
        with nnrun.LLM(model, page_size=4) as llm:
            capture_graphs(llm) if graphs else use_flashinfer(llm)
            outputs = llm.generate(prompts, params)
        results.append(
            [
                (o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outputs
            ]
        )
    for (eager_tokens, eager_lps), (graph_tokens, graph_lps) in zip(*results):
        assert eager_tokens == graph_tokens
        assert torch.allclose(torch.tensor(eager_lps), torch.tensor(graph_lps), atol=1e-5)


def test_batches_larger_than_every_graph_run_eagerly(fake):
    model = make_sharp_model("llama")
    oracle = make_twin(model)
    prompts = random_prompts([3, 5, 7], seed=4)
    with nnrun.LLM(model, page_size=4) as llm:
        capture_graphs(llm, sizes=[1, 2])
        counts = count_decode_steps(llm)
        outputs = llm.generate(prompts, greedy_params(3))
    assert counts == {"replayed": 0, "eager": 2}
    for prompt, output in zip(prompts, outputs):
        expected = hf_logits(oracle, prompt + output.outputs[0].token_ids).argmax(-1)
        assert output.outputs[0].token_ids == expected[len(prompt) - 1 : -1].tolist()


def test_steps_with_module_hooks_run_eagerly_so_the_hooks_fire(fake):
    check_hooked_steps_run_eagerly_and_replay_after()


def check_hooked_steps_run_eagerly_and_replay_after(**engine_kwargs) -> None:
    """A forward hook on a layer fires in every step of a generation (its decode steps eager); without it, they replay."""
    model = make_sharp_model("llama")
    with nnrun.LLM(model, page_size=4, **engine_kwargs) as llm:
        capture_graphs(llm)
        counts = count_decode_steps(llm)
        seen = []
        handle = llm.model.model.layers[0].register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
        try:
            llm.generate(random_prompts([5, 8]), greedy_params(4))
        finally:
            handle.remove()
        assert seen == [13, 2, 2, 2] and counts == {"replayed": 0, "eager": 3}
        llm.generate(random_prompts([5, 8]), greedy_params(4))
        assert counts == {"replayed": 3, "eager": 3}


def test_traced_steps_run_eagerly_and_untraced_ones_replay(fake):
    """An nnsight trace sees every decode step; with graphs captured its values equal an engine without them."""
    saved = []
    for graphs in (False, True):
        model = nnrun.LanguageModel("tiny-facts")
        llm = model.engine
        capture_graphs(llm) if graphs else use_flashinfer(llm)
        counts = count_decode_steps(llm)
        with model.generate("The Eiffel Tower is in", max_new_tokens=3) as tracer:
            hidden = list().save()
            for step in tracer.iter[:3]:
                hidden.append(model.model.layers[1].output[0, -1])
        saved.append(torch.stack(list(hidden)))
        assert counts == {"replayed": 0, "eager": 2}
        llm.generate(["The Colosseum is in"], greedy_params(3))
        assert counts["replayed"] == (2 if graphs else 0)
        model.shutdown()
    assert torch.allclose(saved[0], saved[1], atol=1e-6)


def test_graph_mode_calls_bind_to_the_real_flashinfer_signatures(fake):
    """The graph-mode constructor, plan and run calls bind to the installed flashinfer (skipped without it)."""
    import inspect

    del sys.modules["flashinfer"]  # the fake, put back by the fixture's monkeypatch
    real = pytest.importorskip("flashinfer")
    sys.modules["flashinfer"] = fake
    with nnrun.LLM(make_sharp_model("gemma2"), page_size=4) as llm:
        capture_graphs(llm, sizes=[2])
        llm.generate(random_prompts([3, 6]), greedy_params(3))
    graph_calls = [call for call in fake.calls if getattr(call.wrapper, "use_cuda_graph", False)]
    assert {call.kind for call in graph_calls} == {"init", "plan", "run"}
    real_cls = real.BatchDecodeWithPagedKVCacheWrapper
    for call in graph_calls:
        method = "__init__" if call.kind == "init" else call.kind
        inspect.signature(getattr(real_cls, method)).bind(None, *call.args, **call.kwargs)
        if method == "plan" and hasattr(real_cls, "_plan_impl"):
            inspect.signature(real_cls._plan_impl).bind(None, *call.args, **call.kwargs)
