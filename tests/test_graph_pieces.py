"""Decode graphs in decoder-layer pieces: a watched step replays every layer no block waits in.

On CPU with the CUDA-graph stand-in (tests/fake_cuda_graph.py) and the FlashInfer emulator. The
oracles: the all-eager step (nnrun with no graphs captured, the same kernels) and nnsight on HF.
Each test also counts which layers replayed, so a pass cannot come from a step that ran eagerly.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter

import pytest
import torch

import nnrun
from conformance.compare import assert_scenario_same
from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin
from fake_cuda_graph import HostSyncDuringCapture, RecordingCapturer
from fake_flashinfer import make_fake_flashinfer
from model_zoo import make_twin, random_prompts
from nnrun.graph_pieces import decoder_layers
from test_cuda_graphs import capture_graphs, count_decode_steps, fake, greedy_params  # noqa: F401 (fixture)
from test_flashinfer_emulated import FAMILIES, make_sharp_model, use_flashinfer

P = "the eiffel tower is in the city of"
Q = "hello world"
NEW_TOKENS = 5
NUM_LAYERS = 4


@pytest.fixture
def models(monkeypatch):
    """nnsight on HF, nnrun all eager, and nnrun with whole-step and per-layer graphs; replays per layer."""
    monkeypatch.setitem(sys.modules, "flashinfer", make_fake_flashinfer())
    model = tiny_llama(seed=4, num_layers=NUM_LAYERS)
    oracle = hf_language_model(twin(model), tiny_tokenizer())
    eager = nnrun.LanguageModel(twin(model), tokenizer=tiny_tokenizer())
    use_flashinfer(eager.engine)  # the same attention kernels, and no graphs
    ours = nnrun.LanguageModel(model, tokenizer=tiny_tokenizer(), cuda_graph_pieces=True)
    capturer = capture_graphs(ours.engine)
    runner = ours.engine.runner
    assert runner.graph_pieces is not None
    replayed: Counter = Counter()
    gate = runner.watched_layers
    replayed_one = gate.replayed

    def counting(layer_index: int) -> None:
        replayed[layer_index] += 1
        replayed_one(layer_index)

    gate.replayed = counting
    counts = count_decode_steps(ours.engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield oracle, eager, ours, replayed, counts, capturer
    ours.shutdown()
    eager.shutdown()


def save_layer_every_step(model, layer: int, prompts=(P, Q)) -> torch.Tensor:
    """Layer `layer`'s output at every step of the first prompt's generation: `[steps, T_or_1, H]` rows."""
    with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
        hidden = list().save()
        with tracer.invoke(prompts[0]):
            for _ in tracer.all():
                hidden.append(model.model.layers[layer].output[0, -1])
        for prompt in prompts[1:]:
            with tracer.invoke(prompt):
                pass
        with tracer.invoke():
            ids = tracer.result.save()
    return torch.stack(list(hidden)), ids


def test_pieces_and_eager_points_equal_the_all_eager_step(models):
    """Layer 2 read every step: the other layers replay (after the first decode step, which learns the
    layers' visits), and the reads, the tokens, equal the all-eager run bitwise and nnsight on HF's."""
    oracle, eager, ours, replayed, counts, _ = models
    hidden, ids = save_layer_every_step(ours, 2)
    eager_hidden, eager_ids = save_layer_every_step(eager, 2)
    oracle_hidden, oracle_ids = save_layer_every_step(oracle, 2)
    assert hidden.shape[0] == NEW_TOKENS
    assert torch.equal(hidden, eager_hidden) and torch.equal(ids, eager_ids)
    torch.testing.assert_close(hidden, oracle_hidden, atol=1e-5, rtol=1e-5)
    assert torch.equal(ids.cpu(), oracle_ids.cpu())
    decode_steps = NEW_TOKENS - 1
    assert counts["eager"] == decode_steps  # no whole-step graph: a block watches these steps
    # Layer 2 is watched only at its output: it replays inside its handoffs (issue 35) as the others replay bare.
    assert replayed[2] == decode_steps - 1
    assert all(replayed[layer] == decode_steps - 1 for layer in (0, 1, 3)), replayed


def test_a_point_inside_a_layer_runs_that_layer_eagerly(models):
    """A block on `layers.1.self_attn.o_proj.output` runs layer 1 eagerly; its value is HF's."""
    oracle, _, ours, replayed, _, _ = models

    def scenario(model):
        with model.generate(P, max_new_tokens=NEW_TOKENS) as tracer:
            values = list().save()
            for _ in tracer.all():
                values.append(model.model.layers[1].self_attn.o_proj.output[0, -1])
        return torch.stack(list(values))

    torch.testing.assert_close(scenario(ours), scenario(oracle), atol=1e-5, rtol=1e-5)
    assert replayed[1] == 0 and replayed[0] == replayed[2] == replayed[3] == NEW_TOKENS - 2


def test_steering_one_layer_replays_the_others_with_hfs_tokens(models):
    oracle, _, ours, replayed, _, _ = models
    vector = torch.linspace(-2.0, 2.0, 64)

    def scenario(model):
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            with tracer.invoke(P):
                for _ in tracer.all():
                    model.model.layers[3].output[:] += vector
            with tracer.invoke(Q):
                pass
            with tracer.invoke():
                ids = tracer.result.save()
        return ids

    assert torch.equal(scenario(ours).cpu(), scenario(oracle).cpu())
    # Layer 3 is steered at its output only: it replays inside its handoffs (issue 35), the edit on its copy.
    assert replayed[3] == replayed[0] == NEW_TOKENS - 2


def test_a_block_moving_on_to_a_later_layer_in_the_step_finds_it_eager(models):
    """Layer 0 and then layer 3 each step: the gate decides at each layer, so both run eagerly."""
    oracle, _, ours, replayed, _, _ = models

    def scenario(model):
        with model.generate(P, max_new_tokens=NEW_TOKENS) as tracer:
            first, last = list().save(), list().save()
            for _ in tracer.all():
                first.append(model.model.layers[0].output[0, -1])
                last.append(model.model.layers[3].output[0, -1])
        return torch.stack(list(first)), torch.stack(list(last))

    for ours_value, oracle_value in zip(scenario(ours), scenario(oracle)):
        torch.testing.assert_close(ours_value, oracle_value, atol=1e-5, rtol=1e-5)
    # Layers 0 and 3 are read at their outputs only: they replay inside their handoffs (issue 35), after the
    # block moved on from layer 0 to wait on layer 3, as layers 1 and 2 replay bare.
    assert replayed[0] == replayed[3] == replayed[1] == replayed[2] == NEW_TOKENS - 2


def test_replayed_layers_keep_the_visit_counts_a_later_read_relies_on(models):
    """Layer 1 replays in the steps before the block asks for it; `tracer.iter[4]` is still the fifth forward."""
    oracle, _, ours, replayed, _, _ = models

    def scenario(model):
        with model.generate(P, max_new_tokens=NEW_TOKENS) as tracer:
            for _ in tracer.iter[2:3]:
                early = model.model.layers[3].output.save()
            for _ in tracer.iter[4:5]:
                late = model.model.layers[1].output.save()
        return early, late

    for ours_value, oracle_value in zip(scenario(ours), scenario(oracle)):
        torch.testing.assert_close(ours_value, oracle_value, atol=1e-5, rtol=1e-5)
    assert replayed[1] >= 1  # it did replay before the read


class EagerAt:
    """A `PieceGate` that runs the given layers eagerly and replays the rest, counting replays."""

    def __init__(self, eager_layers: set[int]) -> None:
        self.eager_layers = eager_layers
        self.replays: Counter = Counter()

    def runs_eagerly(self, layer_index: int) -> bool:
        return layer_index in self.eager_layers

    def run_eagerly(self, layer_index: int, call):
        return call()

    def replayed(self, layer_index: int) -> None:
        self.replays[layer_index] += 1


def greedy_outputs(llm: nnrun.LLM, prompts, lengths):
    outputs = llm.generate(prompts, [greedy_params(n) for n in lengths])
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_equal_the_all_eager_step_as_the_batch_shrinks(fake, family):
    """Batches of 5, 4, ... pad to the graphs of 8, 4, 2, 1 (stale rows from larger batches in the
    shared static buffers); layer 1 eager and the others replayed give the all-eager run's tokens
    and logprobs, on the same kernels."""
    model = make_sharp_model(family)
    prompts = random_prompts([3, 17, 9, 1, 12], seed=5)
    lengths = [2, 7, 4, 6, 3]
    with nnrun.LLM(make_twin(model), page_size=4) as eager:
        use_flashinfer(eager)
        expected = greedy_outputs(eager, prompts, lengths)
    with nnrun.LLM(model, page_size=4, cuda_graph_pieces=True) as llm:
        runner = llm.runner
        runner.captures_graph_pieces = True
        capture_graphs(llm)
        assert runner.graph_pieces is not None
        gate = EagerAt({1})
        runner.piece_gate = lambda forward_batch: gate
        runner.can_use_cuda_graph = lambda forward_batch: False  # every decode step in pieces
        got = greedy_outputs(llm, prompts, lengths)
        llm.runner.allocator.check_no_leaks()
    num_layers = len(decoder_layers(model))
    assert gate.replays[1] == 0
    assert all(gate.replays[layer] == max(lengths) - 1 for layer in range(num_layers) if layer != 1), gate.replays
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(got, expected):
        assert tokens == expected_tokens, family
        for row, expected_row in zip(logprobs, expected_logprobs):
            for token, value in expected_row.items():
                assert abs(row[token] - value) < 1e-5, family  # float rounding: padded matmuls


def test_routed_layers_keep_their_class_name_and_get_it_back(fake):
    with nnrun.LLM(make_sharp_model("llama"), page_size=4, cuda_graph_pieces=True) as llm:
        runner = llm.runner
        layer = decoder_layers(runner.model)[0]
        cls = type(layer)
        runner.captures_graph_pieces = True
        capture_graphs(llm)
        assert type(layer).__name__ == cls.__name__ and isinstance(layer, cls) and type(layer) is not cls
        runner.graph_pieces.remove()
        assert type(layer) is cls


def test_a_source_read_every_step_runs_the_step_eagerly_with_hfs_values(models):
    """`.source` drills into an op of a layer: no pieces while it is drilled, and HF's values."""
    oracle, _, ours, replayed, _, _ = models

    def scenario(model):
        with model.generate(P, max_new_tokens=NEW_TOKENS) as tracer:
            values = list().save()
            for _ in tracer.all():
                values.append(model.model.layers[2].self_attn.source.self_q_proj_0.output[0, -1])
        return torch.stack(list(values))

    torch.testing.assert_close(scenario(ours), scenario(oracle), atol=1e-5, rtol=1e-5)


def test_a_cache_of_one_layer_replays_it_inside_its_handoffs(models):
    """`tracer.cache` observes layer 1 through the generation: it sees only layer 1's boundary, so every layer
    replays, layer 1 inside its handoffs, and the cache holds nnsight on HF's values."""
    oracle, _, ours, replayed, _, _ = models

    def scenario(model):
        with model.generate(P, max_new_tokens=NEW_TOKENS) as tracer:
            cache = tracer.cache(modules=[model.model.layers[1]]).save()
        return cache["model.model.layers.1"].output

    torch.testing.assert_close(scenario(ours), scenario(oracle), atol=1e-5, rtol=1e-5)
    # The cache observes layer 1's boundary only: it replays inside its handoffs (issue 35), which the cache records.
    assert replayed[1] == replayed[0] == NEW_TOKENS - 2


class FailingAfter(RecordingCapturer):
    """A capturer whose captures fail after the first `limit` (a layer a GPU graph cannot hold)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def capture(self, fn):
        if self.captures >= self.limit:
            raise HostSyncDuringCapture("this layer reads a device value on the host")
        return super().capture(fn)


def test_a_model_whose_layers_cannot_be_captured_keeps_whole_step_graphs(fake):
    """Decided once at init: no pieces, the layers' own classes back, the whole-step graphs kept."""
    with nnrun.LLM(make_sharp_model("llama"), page_size=4, cuda_graph_pieces=True) as llm:
        runner = llm.runner
        cls = type(decoder_layers(runner.model)[0])
        use_flashinfer(llm)
        runner.config.device.cuda_graph_batch_sizes = [1, 2]
        runner.captures_graph_pieces = True
        runner.init_cuda_graphs(capturer=FailingAfter(limit=3))  # the 2 whole-step graphs, then 1 piece
        assert runner.graph_pieces is None and runner.graph_runner is not None
        assert all(type(layer) is cls for layer in decoder_layers(runner.model))


def test_skipping_a_layer_every_step_gives_hfs_tokens(models):
    oracle, _, ours, _, _, _ = models

    def scenario(model):
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            with tracer.invoke(P):
                for _ in tracer.all():
                    model.model.layers[2].skip(model.model.layers[1].output)
            with tracer.invoke():
                ids = tracer.result.save()
        return ids

    assert torch.equal(scenario(ours).cpu(), scenario(oracle).cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pieces_equal_the_eager_step_on_flashinfer():
    """On CUDA (FlashInfer, real graphs): layer 1 read every step, layer 0 replayed from its graph;
    the reads and tokens equal an engine with no graphs on the same kernels."""
    from test_gpu_flashinfer import gpu_model

    model = gpu_model("llama_hd128", torch.bfloat16).to("cuda")  # benchmarks/gpu.py's 8B kernels: compiled once
    eager = nnrun.LanguageModel(
        twin(model), tokenizer=tiny_tokenizer(), device="cuda", dtype=torch.bfloat16, enable_cuda_graphs=False
    )
    ours = nnrun.LanguageModel(
        model, tokenizer=tiny_tokenizer(), device="cuda", dtype=torch.bfloat16, cuda_graph_pieces=True
    )
    try:
        runner = ours.engine.runner
        assert runner.attn_backend.name == "flashinfer" and runner.graph_pieces is not None
        replayed: Counter = Counter()
        replayed_one = runner.watched_layers.replayed
        runner.watched_layers.replayed = lambda i: (replayed.update([i]), replayed_one(i))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got_hidden, got_ids = save_layer_every_step(ours, 1, prompts=(P, Q, "a b c"))
            want_hidden, want_ids = save_layer_every_step(eager, 1, prompts=(P, Q, "a b c"))
        # Layer 1 is read at its output only: it replays inside its handoffs (issue 35).
        assert replayed[0] == replayed[1] == NEW_TOKENS - 2
        assert torch.equal(got_ids.cpu(), want_ids.cpu())
        torch.testing.assert_close(got_hidden.float(), want_hidden.float(), atol=2e-2, rtol=2e-2)
    finally:
        ours.shutdown()
        eager.shutdown()


def test_pieces_default_on_wherever_decode_graphs_are():
    """Unset, pieces come with any device's decode graphs (CUDA's, the CPU's traced ones); False turns them off."""
    from nnrun.config import DeviceConfig

    assert DeviceConfig().graph_pieces_on() and DeviceConfig(cuda_graph_pieces=True).graph_pieces_on()
    assert not DeviceConfig(cuda_graph_pieces=False).graph_pieces_on()


# ---- a layer watched only at its boundary replays inside its handoffs (issue 35) ---------------


def test_saving_every_layers_output_every_step_replays_every_layer(models):
    """Every layer's output saved every step, for both prompts: every layer is watched, and every layer
    replays (inside its handoffs) after the first decode step; the reads equal the all-eager step
    bitwise and nnsight on HF's, and so do the tokens."""
    oracle, eager, ours, replayed, counts, _ = models

    def scenario(model):
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            hidden = list().save()
            for prompt in (P, Q):
                with tracer.invoke(prompt):
                    for _ in tracer.all():
                        for layer in range(NUM_LAYERS):
                            hidden.append(model.model.layers[layer].output[0, -1])
            with tracer.invoke():
                ids = tracer.result.save()
        return torch.stack(list(hidden)), ids

    hidden, ids = scenario(ours)
    eager_hidden, eager_ids = scenario(eager)
    oracle_hidden, oracle_ids = scenario(oracle)
    assert hidden.shape[0] == 2 * NEW_TOKENS * NUM_LAYERS
    assert torch.equal(hidden, eager_hidden) and torch.equal(ids, eager_ids)
    torch.testing.assert_close(hidden, oracle_hidden, atol=1e-5, rtol=1e-5)
    assert torch.equal(ids.cpu(), oracle_ids.cpu())
    decode_steps = NEW_TOKENS - 1
    assert counts["eager"] == decode_steps
    assert all(replayed[layer] == decode_steps - 1 for layer in range(NUM_LAYERS)), replayed


@pytest.mark.parametrize("how", ["in_place", "assignment"])
def test_an_edit_of_a_layers_output_reaches_the_next_layer(models, how):
    """Layer 1's output steered (in place, or by assignment) for one of two prompts, layer 2's output read:
    both layers replay inside their handoffs and layer 2 sees the edit, as on nnsight on HF."""
    oracle, _, ours, replayed, _, _ = models
    vector = torch.linspace(-1.0, 1.0, 64)

    def scenario(model):
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            with tracer.invoke(P):
                following = list().save()
                for _ in tracer.all():
                    if how == "in_place":
                        model.model.layers[1].output[:] += vector
                    else:
                        model.model.layers[1].output = model.model.layers[1].output + vector
                    following.append(model.model.layers[2].output[0, -1])
            with tracer.invoke(Q):
                pass
            with tracer.invoke():
                ids = tracer.result.save()
        return torch.stack(list(following)), ids

    (following, ids), (oracle_following, oracle_ids) = scenario(ours), scenario(oracle)
    torch.testing.assert_close(following, oracle_following, atol=1e-5, rtol=1e-5)
    assert torch.equal(ids.cpu(), oracle_ids.cpu())
    assert replayed[1] == replayed[2] == replayed[0] == NEW_TOKENS - 2, replayed


@pytest.mark.parametrize("how", ["in_place", "assignment"])
def test_an_edit_of_a_layers_input_reaches_its_replay(models, how):
    """Layer 2's input steered (in place, or by assignment) every step: the replay loads the edited input
    (an assignment hands the forward a new tensor); HF's values and tokens."""
    oracle, _, ours, replayed, _, _ = models
    vector = torch.linspace(-1.0, 1.0, 64)

    def scenario(model):
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            with tracer.invoke(P):
                outputs = list().save()
                for _ in tracer.all():
                    if how == "in_place":
                        model.model.layers[2].input[:] += vector
                    else:
                        model.model.layers[2].input = model.model.layers[2].input + vector
                    outputs.append(model.model.layers[2].output[0, -1])
            with tracer.invoke():
                ids = tracer.result.save()
        return torch.stack(list(outputs)), ids

    (outputs, ids), (oracle_outputs, oracle_ids) = scenario(ours), scenario(oracle)
    torch.testing.assert_close(outputs, oracle_outputs, atol=1e-5, rtol=1e-5)
    assert torch.equal(ids.cpu(), oracle_ids.cpu())
    assert replayed[2] == NEW_TOKENS - 2, replayed


def test_a_block_served_at_a_layers_input_then_waiting_inside_it_runs_it_eagerly(models):
    """`layers[2].input` then `layers[2].mlp.output` in the same step: decided after the input handoff,
    layer 2 runs its real forward and the block is served inside it; the other layers replay."""
    oracle, _, ours, replayed, _, _ = models

    def scenario(model):
        with model.generate(P, max_new_tokens=NEW_TOKENS) as tracer:
            inputs, mlps = list().save(), list().save()
            for _ in tracer.all():
                inputs.append(model.model.layers[2].input[0, -1])
                mlps.append(model.model.layers[2].mlp.output[0, -1])
        return torch.stack(list(inputs)), torch.stack(list(mlps))

    for ours_value, oracle_value in zip(scenario(ours), scenario(oracle)):
        assert ours_value.shape[0] == NEW_TOKENS
        torch.testing.assert_close(ours_value, oracle_value, atol=1e-5, rtol=1e-5)
    assert replayed[2] == 0 and replayed[1] == replayed[3] == NEW_TOKENS - 2, replayed


def test_a_skip_of_one_request_next_to_a_boundary_read_equals_the_all_eager_step(models):
    """One prompt skips layer 2 with layer 1's output (read at its boundary), the other runs it: layer 1
    replays inside its handoffs, layer 2 runs (the skip spliced into its output); the all-eager step's tokens."""
    _, eager, ours, replayed, _, _ = models

    def scenario(model):
        with model.generate(max_new_tokens=NEW_TOKENS) as tracer:
            with tracer.invoke(P):
                for _ in tracer.all():
                    model.model.layers[2].skip(model.model.layers[1].output)
            with tracer.invoke(Q):
                pass
            with tracer.invoke():
                ids = tracer.result.save()
        return ids

    assert torch.equal(scenario(ours).cpu(), scenario(eager).cpu())
    assert replayed[1] == NEW_TOKENS - 2 and replayed[2] == 0, replayed


GENERATE_SCENARIOS = [
    "all_generated_tokens",
    "generate_default_length",
    "generate_repetition_penalty",
    "generate_result",
    "generate_several_invokes",
    "iter_over_generated_tokens",
    "iter_slice",
    "samples_across_steps",
    "steering_during_generation",
]


@pytest.fixture(scope="module")
def conformance_models():
    """nnsight on HF and nnrun with graph pieces on the conformance suite's tiny Llama."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "flashinfer", make_fake_flashinfer())
        model = tiny_llama()
        oracle = hf_language_model(twin(model), tiny_tokenizer())
        ours = nnrun.LanguageModel(model, tokenizer=tiny_tokenizer(), cuda_graph_pieces=True)
        capture_graphs(ours.engine)
        assert ours.engine.runner.graph_pieces is not None
        yield oracle, ours
        ours.shutdown()


@pytest.mark.parametrize("name", GENERATE_SCENARIOS)
def test_generate_conformance_scenarios_with_pieces(conformance_models, name):
    """nnsight's generate scenarios save on nnrun with graph pieces what they save on nnsight on HF."""
    oracle, ours = conformance_models
    assert_scenario_same(name, oracle, ours, tiny_tokenizer())


@pytest.mark.parametrize("model_type", ["gemma3", "got_ocr2"])
def test_the_decoder_layers_are_the_text_decoders_not_a_towers_of_the_same_length(model_type):
    """A multimodal model's vision tower may hold a layer list as long as the text config's: the pieces route the
    text decoder's layers (HF's `get_decoder()`), the ones a decode step calls."""
    from families.tiny import tiny_model
    from nnrun.graph_pieces import decoder_layers

    model = tiny_model(model_type)
    towers = [m for name, m in model.named_modules() if "vision" in name and isinstance(m, torch.nn.ModuleList)]
    assert any(len(tower) == len(model.get_decoder().layers) for tower in towers)  # the trap is there
    assert decoder_layers(model) is model.get_decoder().layers
