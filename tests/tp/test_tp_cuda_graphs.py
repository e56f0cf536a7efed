"""Decode CUDA graphs on two tensor-parallel ranks (tiny-facts), on CPU, under the recording stand-in.

gloo's collectives cannot be captured, so no real graph is made here. Each rank runs
`RecordingShardRunner` instead of the shard runner (the front end names its rank runner; these
tests name one of theirs): it attends with the FlashInfer emulator in its graph mode and captures
under tests/fake_cuda_graph.py's `RecordingCapturer`, which replays the recorded ops, the ranks'
all-reduces included, without running Python. Everything else is the product's path: the rank
decides per step whether to replay, pads the batch, and answers the front end.

Oracles: the same two ranks with graphs turned off, and one rank (tokens bitwise, greedy); for a
traced step's values, plain HF.
"""

from __future__ import annotations

import pickle
import sys

import pytest
import torch
import torch.distributed as dist

import nnrun
from fake_cuda_graph import HostSyncDuringCapture, RecordingCapturer
from fake_flashinfer import make_fake_flashinfer
from interleaver.tp_rank import NNsightShardRunner
from nnrun import LLM, SamplingParams
from nnrun.forward_batch import ForwardMode
from nnrun.tp import TensorParallelError, TensorParallelRunner
from nnrun.tp.worker import ShardRunner
from tolerance import assert_close_packed

pytestmark = pytest.mark.slow

GRAPH_SIZES = [1, 2, 4]
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is", "Paris is the capital of"]
# Four rows ending at different lengths: decode batches of 4, 3, 2 and 1 (3 replays the graph of 4).
SHRINKING = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 5, 12)]
# Graph and eager forwards on the ranks run the same kernels over other row counts: fp32 sums may reorder.
RTOL, ATOL = 1e-5, 1e-5


class RecordingGraphsOnRank:
    """Test seam for a rank runner: FlashInfer emulated, graphs captured by the recording stand-in,
    and a `graph_counts` exchange that answers every rank's captures, replays and eager decode steps."""

    def init_attention_backend(self) -> None:
        from nnrun.attention.flashinfer_backend import FlashInferAttnBackend

        sys.modules["flashinfer"] = make_fake_flashinfer()  # the rank's own process: nothing else imports it
        self.attn_backend = FlashInferAttnBackend(self.kv_pool, self.device, self.layers, workspace_bytes=1 << 16)

    def init_cuda_graphs(self, capturer=None) -> None:
        self.capturer = RecordingCapturer()
        self.decode_steps = {"replayed": 0, "eager": 0}
        super().init_cuda_graphs(self.capturer)

    def run_model(self, forward_batch):
        if forward_batch.forward_mode is ForwardMode.DECODE and self.exact_forward is None:
            self.decode_steps["replayed" if self._replays_graph(forward_batch) else "eager"] += 1
        return super().run_model(forward_batch)

    def serve_exchange(self, message: dict) -> bytes | None:
        if message["op"] != "graph_counts":
            return super().serve_exchange(message)
        counts = {"captures": self.capturer.captures, "replays": self.capturer.replays, **self.decode_steps}
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, counts)
        return pickle.dumps(every_rank)


class RecordingShardRunner(RecordingGraphsOnRank, ShardRunner):
    pass


class RecordingNNsightShardRunner(RecordingGraphsOnRank, NNsightShardRunner):
    pass


class RecordingTensorParallelRunner(TensorParallelRunner):
    rank_runner = f"{__name__}:RecordingShardRunner"


class RefusedCapturer(RecordingCapturer):
    def capture(self, fn):
        raise HostSyncDuringCapture("aten._local_scalar_dense reads device data on the host (as CUDA would refuse)")


class CaptureRefusingShardRunner(RecordingShardRunner):
    def init_cuda_graphs(self, capturer=None) -> None:
        ShardRunner.init_cuda_graphs(self, RefusedCapturer())


class TorchAttentionOnRank1ShardRunner(RecordingShardRunner):
    def init_attention_backend(self) -> None:
        if dist.get_rank() == 0:
            super().init_attention_backend()
        else:
            ShardRunner.init_attention_backend(self)  # the torch backend on a CPU rank


def rank_counts(llm: LLM) -> list[dict]:
    """Per rank: graphs captured, graphs replayed, decode steps replayed and run eagerly."""
    with llm.runner.step_lock:  # between steps
        return pickle.loads(llm.runner.group.exchange(pickle.dumps({"op": "graph_counts"})))


def added(after: list[dict], before: list[dict]) -> list[dict]:
    return [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]


def tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def _two_ranks(**options) -> LLM:
    return LLM(
        "tiny-facts",
        tensor_parallel_size=2,
        tensor_parallel_timeout=60,
        runner_cls=RecordingTensorParallelRunner,
        cuda_graph_batch_sizes=GRAPH_SIZES,
        page_size=4,
        **{"tensor_parallel_cuda_graphs": True, **options},
    )


@pytest.fixture(scope="module")
def graphs():
    """Two ranks that replay graphs; a pool of 160 pages of 4 tokens (the preemption test fills it)."""
    llm = _two_ranks(max_total_tokens=640)
    yield llm
    assert llm.shutdown(timeout=30)


@pytest.fixture(scope="module")
def eager():
    llm = _two_ranks(enable_cuda_graphs=False)
    yield llm
    assert llm.shutdown(timeout=30)


@pytest.fixture(scope="module")
def one_rank():
    llm = LLM("tiny-facts")
    yield llm
    llm.shutdown()


def test_ranks_capture_no_graphs_unless_asked():
    llm = _two_ranks(tensor_parallel_cuda_graphs=False)
    try:
        assert llm.runner.rank_graph_batch_sizes is None
        assert [c["captures"] for c in rank_counts(llm)] == [0, 0]
    finally:
        assert llm.shutdown(timeout=30)


def test_each_rank_captures_the_same_graphs(graphs, eager):
    assert graphs.runner.rank_graph_batch_sizes == GRAPH_SIZES
    counts = rank_counts(graphs)
    assert [c["captures"] for c in counts] == [len(GRAPH_SIZES)] * 2
    assert eager.runner.rank_graph_batch_sizes is None
    assert [c["captures"] for c in rank_counts(eager)] == [0, 0]


@pytest.mark.parametrize(
    ("rank_runner", "error"),
    [
        ("CaptureRefusingShardRunner", "capturing the decode CUDA graphs of a tensor-parallel rank failed"),
        ("TorchAttentionOnRank1ShardRunner", "the tensor-parallel ranks chose different attention backends"),
    ],
)
def test_ranks_that_cannot_capture_alike_refuse_to_start(monkeypatch, rank_runner, error):
    monkeypatch.setattr(RecordingTensorParallelRunner, "rank_runner", f"{__name__}:{rank_runner}")
    with pytest.raises(TensorParallelError, match=error):
        _two_ranks()


def test_untraced_decode_steps_replay_on_both_ranks_with_eager_and_one_rank_tokens(graphs, eager, one_rank):
    """Batches of 4, 3 (padded to 4), 2 and 1: padding rows follow rows a larger batch left behind."""
    before = rank_counts(graphs)
    ours = graphs.generate(PROMPTS, SHRINKING)
    counts = added(rank_counts(graphs), before)
    decode_steps = max(p.max_tokens for p in SHRINKING) - 1
    assert counts[0] == counts[1] == {"captures": 0, "replays": decode_steps, "replayed": decode_steps, "eager": 0}
    assert tokens(ours) == tokens(eager.generate(PROMPTS, SHRINKING)) == tokens(one_rank.generate(PROMPTS, SHRINKING))
    graphs.runner.allocator.check_no_leaks()


def test_replayed_logprobs_equal_the_eager_ranks(graphs, eager):
    """The logits cross to the front end's sampler (logprobs asked): the rows the graph wrote, not padding."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True) for n in (4, 7, 2)]
    prompts = PROMPTS[:3]
    ours, theirs = graphs.generate(prompts, params), eager.generate(prompts, params)
    assert tokens(ours) == tokens(theirs)
    for a, b in zip(ours, theirs):
        for mine, expected in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert mine.keys() == expected.keys()
            torch.testing.assert_close(
                torch.tensor([mine[t] for t in sorted(mine)]),
                torch.tensor([expected[t] for t in sorted(expected)]),
                rtol=RTOL,
                atol=ATOL,
            )


def test_batches_larger_than_every_graph_run_eagerly_on_both_ranks(graphs, one_rank):
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS[:3]]  # six rows; the largest graph holds four
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 3, 4, 5, 6, 7)]
    before = rank_counts(graphs)
    ours = graphs.generate(prompts, params)
    counts = added(rank_counts(graphs), before)
    # rows left per decode step: 6, 5, 4, 3, 2, 1 -> two eager steps, then four replays
    assert counts[0] == counts[1] == {"captures": 0, "replays": 4, "replayed": 4, "eager": 2}
    assert tokens(ours) == tokens(one_rank.generate(prompts, params))


def test_preemption_during_replays_changes_no_token_and_leaks_no_kv(graphs, one_rank):
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]  # 8 requests of about 90 tokens: 200 pages > 160
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    before, preemptions = rank_counts(graphs), graphs.core.scheduler.num_preemptions
    ours = graphs.generate(prompts, params)
    counts = added(rank_counts(graphs), before)
    assert graphs.core.scheduler.num_preemptions > preemptions
    assert counts[0] == counts[1] and counts[0]["replayed"] > 0
    assert tokens(ours) == tokens(one_rank.generate(prompts, params))
    graphs.runner.allocator.check_no_leaks()


def test_abort_during_replays_leaks_no_kv(graphs):
    before = rank_counts(graphs)
    long_one = graphs.submit(PROMPTS[0], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    short = graphs.generate(PROMPTS[1], SHRINKING[1])[0]  # decode steps that replay beside the long request
    graphs.abort([long_one.request_id])
    with pytest.raises(RuntimeError, match="aborted"):
        long_one.result(timeout=60)
    assert len(short.outputs[0].token_ids) == SHRINKING[1].max_tokens
    assert graphs.generate(PROMPTS[2], SHRINKING[0])[0].outputs[0].token_ids
    counts = added(rank_counts(graphs), before)
    assert counts[0] == counts[1] and counts[0]["replayed"] > 0
    graphs.runner.allocator.check_no_leaks()


# ---- nnsight ranks: a traced step runs eagerly on every rank ----------------------------------------
@pytest.fixture(scope="module")
def nnsight_graphs():
    from interleaver.tp_front import TensorParallelNNsightRunner

    patch = pytest.MonkeyPatch()
    patch.setattr(TensorParallelNNsightRunner, "rank_runner", f"{__name__}:RecordingNNsightShardRunner")
    try:
        model = nnrun.LanguageModel(
            "tiny-facts",
            tensor_parallel_size=2,
            tensor_parallel_timeout=60,
            tensor_parallel_cuda_graphs=True,
            cuda_graph_batch_sizes=GRAPH_SIZES,
            page_size=4,
        )
    finally:
        patch.undo()
    yield model
    model.shutdown()


def test_a_traced_generation_runs_eagerly_on_every_rank_and_untraced_steps_replay(nnsight_graphs):
    from transformers import AutoModelForCausalLM

    model = nnsight_graphs
    llm = model.engine
    before = rank_counts(llm)
    with model.generate(PROMPTS[0], max_new_tokens=4, min_new_tokens=4) as tracer:
        hidden = list().save()
        for _ in tracer.iter[:4]:
            hidden.append(model.model.layers[1].output[0, -1])
        sequence = tracer.result.save()
    traced = added(rank_counts(llm), before)
    assert traced[0] == traced[1] == {"captures": 0, "replays": 0, "replayed": 0, "eager": 3}

    hf = AutoModelForCausalLM.from_pretrained(nnrun.bundled_model_path("tiny-facts"), dtype=torch.float32).eval()
    ids = sequence[0]  # the prompt and its four new tokens
    with torch.no_grad():
        expected = hf(ids[None], output_hidden_states=True).hidden_states[2][0]  # layer 1's output, [T, H]
    prompt_len = len(ids) - 4
    assert_close_packed(torch.stack(list(hidden)), expected[prompt_len - 1 : -1], rel=1e-5)

    before = rank_counts(llm)
    plain = llm.generate(PROMPTS[:3], SHRINKING[:3])
    untraced = added(rank_counts(llm), before)
    steps = max(p.max_tokens for p in SHRINKING[:3]) - 1
    assert untraced[0] == untraced[1] == {"captures": 0, "replays": steps, "replayed": steps, "eager": 0}
    assert all(output.outputs[0].token_ids for output in plain)
