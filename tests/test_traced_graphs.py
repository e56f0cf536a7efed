"""Decode graphs on CPU (nnrun/traced_graph.py): traced pieces around eager attention, replayed by default.

The oracle is the same engine with graphs off (`enable_cuda_graphs=False`): a replayed step runs the
eager step's ATen kernels in the same order, on the same batch size, so tokens and logprobs must be
bitwise equal. Graphs are captured lazily, at a batch size's CPU_CAPTURE_AFTER-th unwatched decode
step; the tests below run long enough to replay most steps.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import nnrun
from model_zoo import FAMILIES, VOCAB, hf_logits, make_model, make_twin, random_prompts
from nnrun import traced_graph
from nnrun.attention.base import DecodeOps
from nnrun.cuda_graph import CaptureRefused
from nnrun.traced_graph import CPU_CAPTURE_AFTER, TracedCapturer
from test_cuda_graphs import count_replays
from tolerance import assert_close_packed

MAX_TOKENS = [14, 9, 14, 6, 12]  # requests finish at different steps: the batch shrinks through several sizes


@pytest.fixture(autouse=True)
def steps_fast_enough(monkeypatch):
    """Every step counts as fast enough to capture (the timing rule has its own tests below): a loaded machine
    must not decide whether these tests capture."""
    from nnrun import model_runner

    monkeypatch.setattr(model_runner, "CPU_CAPTURE_BELOW_S_PER_LAYER", math.inf)


def generate(model, graphs: bool, params: list[nnrun.SamplingParams], prompts, **engine) -> tuple[list, nnrun.LLM]:
    llm = nnrun.LLM(model, enable_cuda_graphs=graphs, max_num_seqs=8, **engine)
    outputs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], llm


def greedy(max_tokens: int) -> nnrun.SamplingParams:
    return nnrun.SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_decode_steps_give_the_eager_steps_tokens_and_logprobs_bitwise(family):
    model = make_model(family)
    prompts = random_prompts([5, 11, 3, 8, 2])
    params = [greedy(n) for n in MAX_TOKENS]
    eager, _ = generate(model, False, params, prompts)
    llm = nnrun.LLM(model, max_num_seqs=8)
    counts = count_replays(llm)
    outputs = llm.generate(prompts, params)
    replayed = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    graphs = llm.runner.graph_runner
    assert graphs is not None and graphs.refused is None, f"{family}: {graphs and graphs.refused}"
    assert replayed == eager, f"{family}: a replayed decode step differs from the eager one"
    # Every size the batch held for more than CPU_CAPTURE_AFTER steps was captured and then replayed
    assert 5 in graphs.replays and counts["count"] >= MAX_TOKENS[3] - CPU_CAPTURE_AFTER, family


def test_batches_padded_to_the_sizes_asked_for_decode_as_hf():
    """`cuda_graph_batch_sizes` on CPU: batches of 6, 5, 3 and 2 replay the graphs of 8, 4 and 2, their padding
    rows writing the trash slot and attending to nothing; tokens are HF's and logprobs HF's to rounding (a padded
    batch's matmuls round differently from the eager step's, so not bitwise)."""
    model = make_model("llama")
    oracle = make_twin(model)
    prompts = random_prompts([3, 17, 9, 1, 30, 12], seed=7)
    lengths = [8, 19, 12, 17, 24, 15]
    llm = nnrun.LLM(model, max_num_seqs=8, cuda_graph_batch_sizes=[2, 4, 8])
    counts = count_replays(llm)
    outputs = llm.generate(prompts, [greedy(n) for n in lengths])
    llm.runner.allocator.check_no_leaks()
    assert sorted(llm.runner.graph_runner.replays) == [2, 4, 8] and counts["count"] > 0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        expected = torch.log_softmax(hf_logits(oracle, prompt + completion.token_ids), dim=-1)  # [T, V]
        for i, token in enumerate(completion.token_ids):
            row = expected[len(prompt) - 1 + i]
            assert token == row.argmax().item()
            assert_close_packed(torch.tensor(completion.logprobs[i][token]), row[token])


def test_every_size_writes_its_logits_into_one_buffer():
    """One logits buffer of max_num_seqs rows, not one per captured size (256 sizes x a vocabulary each)."""
    llm = nnrun.LLM(make_model("llama"), max_num_seqs=8)
    llm.generate(random_prompts([5, 11, 3, 8, 2]), [greedy(n) for n in (30, 20, 30, 10, 25)])
    logits = llm.runner.graph_runner.logits  # sizes 5, 4, 3 and 2 held for 5+ steps each
    assert len(logits) >= 3 and len({t.untyped_storage().data_ptr() for t in logits.values()}) == 1
    assert logits[5].untyped_storage().nbytes() == 8 * logits[5][0].nbytes


def test_sampled_generation_with_seeds_is_the_eager_one():
    model = make_model("llama")
    prompts = random_prompts([4, 7, 3])
    params = [nnrun.SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=s, logprobs=1) for s in (1, 2, 3)]
    assert generate(model, True, params, prompts)[0] == generate(model, False, params, prompts)[0]


def test_a_hook_added_after_capture_fires_on_every_step_that_follows():
    """A replay runs no Python: a step with a module hook runs eagerly, and its values are still the graph's."""
    model = make_model("llama")
    prompts = random_prompts([5, 6])
    eager, _ = generate(model, False, [greedy(20)] * 2, prompts)
    llm = nnrun.LLM(model, max_num_seqs=8)
    first = llm.generate(prompts, [greedy(20)] * 2)
    assert 2 in llm.runner.graph_runner.replays  # captured while nothing watched
    calls = []
    handle = model.model.layers[1].register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        second = llm.generate(prompts, [greedy(20)] * 2)
    finally:
        handle.remove()
    assert len(calls) == 20  # the prefill and all 19 decode steps ran the layer eagerly
    for outputs in (first, second):
        assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs] == eager


def test_a_forward_that_reads_a_tensor_on_the_host_decodes_eagerly_and_says_why(caplog):
    """A replay would freeze a value read on the host: the capture is refused, and steps stay eager and right."""
    model = make_model("llama")
    norm = model.model.norm
    plain_forward = norm.forward

    def forward_reading_the_host(hidden):
        if float(hidden.abs().max()) < 0:  # never true: only the read matters
            raise AssertionError
        return plain_forward(hidden)

    norm.forward = forward_reading_the_host
    prompts = random_prompts([5, 6])
    eager, _ = generate(model, False, [greedy(12)] * 2, prompts)
    with caplog.at_level(logging.INFO, logger="nnrun.cuda_graph"):
        replayed, llm = generate(model, True, [greedy(12)] * 2, prompts)
    assert replayed == eager
    graphs = llm.runner.graph_runner
    assert not graphs.replays and "__float__ reads a tensor on the host" in graphs.refused
    refusals = [r for r in caplog.records if "capturing a decode graph failed" in r.getMessage()]
    assert [r.levelno for r in refusals] == [logging.INFO]  # said once, and not as a warning: nothing is wrong


def test_watched_steps_run_in_pieces_on_cpu_unless_turned_off():
    from conformance.models import tiny_llama, tiny_tokenizer

    for option, expected in ((None, True), (False, False)):
        lm = nnrun.LanguageModel(tiny_llama(seed=4, num_layers=2), tokenizer=tiny_tokenizer(), cuda_graph_pieces=option)
        try:
            assert (lm.engine.runner.graph_pieces is not None) is expected
        finally:
            lm.shutdown()


def test_graphs_off_decode_eagerly():
    llm = nnrun.LLM(make_model("llama"), enable_cuda_graphs=False)
    llm.generate(random_prompts([5]), greedy(12))
    assert llm.runner.graph_runner is None


class _EagerCalls:
    """A stand-in attention backend: `forward` is what `TracedCapturer` leaves eager."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, layer_idx, q, k, v, terms):
        self.calls += 1
        return q * k.sum() + v  # [N, H, D]

    def decode_ops(self, layer_idx, q, k, v, terms) -> None:
        return None  # no call given as ops: each stays eager between traced runs


def test_a_traced_capture_replays_the_ops_on_the_tensors_read_and_runs_the_eager_calls_between():
    backend = _EagerCalls()
    weight = torch.nn.Parameter(torch.randn(4, 4))
    step_input = torch.randn(3, 4)  # a static buffer: its new contents are read at replay
    written = torch.zeros(3, 4)  # written in place by the captured code
    frozen = torch.tensor([2.0])  # made in Python at capture (not by an op): frozen, as in a CUDA graph

    def forward():
        h = step_input @ weight  # [3, 4]
        q = h.view(3, 2, 2)
        out = backend.forward(0, q, q + 1, q * 2, None).reshape(3, 4)
        written.copy_(out)
        return torch.relu(out) * frozen

    def expected():
        h = step_input @ weight
        q = h.view(3, 2, 2)
        out = (q * (q + 1).sum() + q * 2).reshape(3, 4)
        return out, torch.relu(out) * 2.0

    replay, output = TracedCapturer(backend).capture(forward)
    assert backend.calls == 3  # the warm-up, the recording and a first replay
    for _ in range(3):
        step_input.copy_(torch.randn(3, 4))
        with torch.no_grad():
            weight.mul_(1.5)  # edited in place: the replay reads the same memory
        replay()
        out, result = expected()
        assert torch.equal(written, out) and torch.equal(output, result)
    assert backend.calls == 6 and "forward" not in vars(backend)  # each replay called it once; unpatched after


@pytest.fixture
def traced(monkeypatch) -> list:
    """The runs `traced_graph` hands to the tracer, in order."""
    runs, trace = [], traced_graph._traced

    def counting_trace(run, example):
        runs.append(run)
        return trace(run, example)

    monkeypatch.setattr(traced_graph, "_traced", counting_trace)
    return runs


def test_a_run_whose_only_effect_is_a_write_in_place_is_traced_too(traced):
    """A decoder-layer piece ends by copying its output into a static buffer, which nothing later in the recording
    reads: that last run is traced like the others (it used to run op by op in Python, slower than eager)."""
    backend = _EagerCalls()
    weight = torch.randn(4, 4)
    step_input = torch.randn(3, 4)  # [3, 4] a static input buffer
    static_output = torch.zeros(3, 4)  # [3, 4] a static output buffer

    def piece() -> None:
        q = (step_input @ weight).view(3, 2, 2)
        out = backend.forward(0, q, q, q, None)  # left eager between the two runs, as attention is
        static_output.copy_(torch.tanh(out.reshape(3, 4)))

    replay, output = TracedCapturer(backend).capture(piece)
    assert output is None and len(traced) == 2  # the runs before and after the eager call
    for _ in range(2):
        step_input.copy_(torch.randn(3, 4))
        replay()
        q = (step_input @ weight).view(3, 2, 2)
        assert torch.equal(static_output, torch.tanh((q * q.sum() + q).reshape(3, 4)))


class _CallsAsOps(_EagerCalls):
    """A stand-in backend that gives its call as ops: `q * keys.sum() + v` over the first `length` rows of a pool,
    `length` changing from step to step (as a decode step's KV length does)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = torch.randn(16, 2, 2)
        self.length = 3
        self.fit = True

    def forward(self, layer_idx, q, k, v, terms):
        self.calls += 1
        return q * self.pool[: self.length].reshape(-1).sum() + v

    def decode_ops(self, layer_idx, q, k, v, terms) -> DecodeOps:
        def run(q, k, v, keys):
            return q * keys.reshape(-1).sum() + v

        return DecodeOps(run, lambda: [self.pool[: self.length]], lambda: self.fit)


def test_an_attention_call_given_as_ops_joins_the_trace_whatever_its_kv_length(traced):
    """A call the backend gives as ops (`decode_ops`) is traced with the ops around it, one traced run for the
    whole forward; its step inputs change shape at each replay; a step it does not fit makes the eager call."""
    backend = _CallsAsOps()
    weight = torch.randn(4, 4)
    step_input = torch.randn(3, 4)

    def forward():
        q = (step_input @ weight).view(3, 2, 2)
        return torch.tanh(backend.forward(0, q, q, q * 2, None).reshape(3, 4))

    def expected():
        q = (step_input @ weight).view(3, 2, 2)
        return torch.tanh((q * backend.pool[: backend.length].reshape(-1).sum() + q * 2).reshape(3, 4))

    replay, output = TracedCapturer(backend).capture(forward)
    assert len(traced) == 1 and backend.calls == 2  # one run, traced; the warm-up and the recording called it
    for length in (1, 9, 16, 5):
        backend.length = length
        step_input.copy_(torch.randn(3, 4))
        replay()
        assert torch.equal(output, expected()), length
    assert backend.calls == 2  # every replay ran the call's ops inside the trace
    backend.fit = False
    replay()
    assert torch.equal(output, expected()) and backend.calls == 3  # the backend's own call, the run op by op


def _llama_of_head_dim_64(sliding_window: int | None = None) -> torch.nn.Module:
    """Heads too wide to pack as keys: its decode attention is SDPA (with a window, Mistral's)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    shape.update(num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    if sliding_window is None:
        return LlamaForCausalLM(LlamaConfig(**shape)).eval()
    return MistralForCausalLM(MistralConfig(**shape, sliding_window=sliding_window)).eval()


@pytest.mark.parametrize(
    "build",
    [lambda: make_model("llama"), _llama_of_head_dim_64, lambda: _llama_of_head_dim_64(sliding_window=6)],
    ids=["heads-as-keys", "sdpa", "sdpa-window"],
)
def test_replayed_decode_steps_make_no_eager_attention_call(build):
    """The torch backend's decode attention is in the trace: once a size is captured, its steps call no
    `forward` of the backend, however long the generation goes on (and tokens stay the eager steps')."""
    model = build()
    prompts = random_prompts([5])
    calls_by_length = {}
    for max_tokens in (12, 24):
        llm = nnrun.LLM(model, max_num_seqs=8)
        backend = llm.runner.attn_backend
        forward, calls = backend.forward, []

        def counting(*args, forward=forward, calls=calls):
            calls.append(1)
            return forward(*args)

        backend.forward = counting
        replays = count_replays(llm)
        outputs = llm.generate(prompts, greedy(max_tokens))
        assert replays["count"] == max_tokens - CPU_CAPTURE_AFTER  # decode steps from the capturing one on
        calls_by_length[max_tokens] = len(calls)
        eager, _ = generate(model, False, [greedy(max_tokens)], prompts)
        assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs] == eager
        llm.shutdown()
    assert calls_by_length[12] == calls_by_length[24]


@pytest.mark.parametrize(
    "read", [lambda x: int(x.argmax()), lambda x: x.max().item(), lambda x: x.tolist()[0], lambda x: x.numpy()[0]]
)
def test_a_traced_capture_refuses_a_host_read(read):
    def forward():
        x = torch.randn(3)
        return x * read(x)

    with pytest.raises(CaptureRefused, match="reads a tensor on the host"):
        TracedCapturer(_EagerCalls()).capture(forward)


def test_a_host_read_inside_an_attention_call_is_the_backends_own():
    """The backend plans in Python each step: its calls run eagerly at replay, so they may read the host."""

    class ReadingBackend(_EagerCalls):
        def forward(self, layer_idx, q, k, v, terms):
            return q * float(k.abs().max())

    x = torch.randn(2, 2)
    replay, output = TracedCapturer(backend := ReadingBackend()).capture(lambda: backend.forward(0, x + 1, x, x, None))
    x.copy_(torch.randn(2, 2))
    replay()
    assert torch.equal(output, (x + 1) * float(x.abs().max()))


def test_watched_steps_replay_the_layers_no_block_waits_in_with_the_eager_values():
    """Decoder-layer pieces on CPU (the default): a block reads layer 1 and steers layer 2 every step; the other layers
    replay their traced pieces once their size is captured, and every value equals the all-eager run's."""
    from conformance.models import tiny_llama, tiny_tokenizer, twin

    model = tiny_llama(seed=4, num_layers=4)
    vector = torch.linspace(-2.0, 2.0, model.config.hidden_size)

    def scenario(lm):
        with lm.generate(max_new_tokens=14) as tracer:
            read = list().save()
            with tracer.invoke("the eiffel tower is in the city of"):
                for _ in tracer.all():
                    read.append(lm.model.layers[1].output[0, -1].clone())
                    lm.model.layers[2].output[:] += vector
            with tracer.invoke("hello world"):
                pass
            with tracer.invoke():
                ids = tracer.result.save()
        return torch.stack(list(read)), ids

    eager = nnrun.LanguageModel(twin(model), tokenizer=tiny_tokenizer(), enable_cuda_graphs=False)
    ours = nnrun.LanguageModel(model, tokenizer=tiny_tokenizer())
    try:
        replayed = []
        gate = ours.engine.runner.watched_layers
        replayed_one = gate.replayed
        gate.replayed = lambda index: (replayed.append(index), replayed_one(index))
        expected, got = scenario(eager), scenario(ours)
        pieces = ours.engine.runner.graph_pieces
    finally:
        eager.shutdown()
        ours.shutdown()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert pieces is not None and pieces.refused is None and 2 in pieces.pieces
    # 13 decode steps of 2 rows: captured at the 4th, then layers 0, 1 (at its output) and 3 replay, 2 (edited) too
    assert {0, 1, 3} <= set(replayed) and replayed.count(0) >= 13 - CPU_CAPTURE_AFTER, replayed


def test_a_size_is_captured_once_its_steps_are_fast_enough_and_seen_often_enough():
    from nnrun.cuda_graph import LazyCapture, SizeWatch

    now = [0.0]
    watch = SizeWatch(LazyCapture(after=3, below_s=0.010), clock=lambda: now[0])
    decisions = []
    for step_seconds in (0.030, 0.030, 0.030, 0.004, 0.030):  # the fourth step of size 8 is a fast one
        decisions.append(watch.due(8))
        now[0] += step_seconds
    assert decisions == [False, False, False, False, True]  # 3 seen, but only the 5th has a fast step behind it
    assert watch.fastest[8] == pytest.approx(0.004) and watch.seen[8] == 5
    assert not watch.due(4)  # sizes count apart


def test_steps_too_slow_for_a_capture_to_pay_decode_eagerly(monkeypatch):
    """A replay saves Python, not math: where steps take longer than the limit, no size is captured."""
    from nnrun import model_runner

    monkeypatch.setattr(model_runner, "CPU_CAPTURE_BELOW_S_PER_LAYER", 0.0)
    model = make_model("llama")
    prompts = random_prompts([5, 6])
    eager, _ = generate(model, False, [greedy(16)] * 2, prompts)
    replayed, llm = generate(model, True, [greedy(16)] * 2, prompts)
    graphs = llm.runner.graph_runner
    assert replayed == eager and not graphs.replays and graphs.watch.seen[2] == 15


def test_watched_steps_too_slow_for_a_capture_to_pay_run_eagerly(monkeypatch):
    """Pieces keep the whole-step graphs' rule: where watched steps take longer than the limit, no size's pieces are
    captured (a model whose layers are their matmuls would pay a capture for nothing), and the values are eager."""
    from conformance.models import tiny_llama, tiny_tokenizer
    from nnrun import model_runner

    monkeypatch.setattr(model_runner, "CPU_CAPTURE_BELOW_S_PER_LAYER", 0.0)
    lm = nnrun.LanguageModel(tiny_llama(seed=4, num_layers=2), tokenizer=tiny_tokenizer())
    try:
        with lm.generate(max_new_tokens=10) as tracer:
            with tracer.invoke("the eiffel tower is in the city of"):
                for _ in tracer.all():
                    lm.model.layers[1].output[:] *= 1.5
        pieces = lm.engine.runner.graph_pieces
        assert not pieces.pieces and pieces.num_replays == 0 and pieces.watch.seen[1] >= CPU_CAPTURE_AFTER
    finally:
        lm.shutdown()
