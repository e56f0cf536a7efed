"""Every causal LM family's CPU decode graphs and decoder-layer pieces against its eager steps, bitwise (make test-all).

Decode graphs are on by default on CPU: a family's unwatched decode steps replay its traced ops (its attention
among them where the backend gives it as ops, eager between traced pieces elsewhere) once a batch size is
captured. The oracle is the same engine with graphs off. Each family captures at its first decode step here
(`CPU_CAPTURE_AFTER` 1) and decodes 3 prompts for 8 steps, the batch shrinking as they finish; tokens and
logprobs must be bitwise equal. A family whose capture is refused (a host read in its forward) decodes eagerly
and must still be equal; the refusal is allowed, a difference is not.

Decoder-layer pieces are on by default too: the second sweep reads a middle layer and steers the next one at
every decode step of a generation, pieces captured at the first watched step, against the same with pieces off.
At the time of writing: 117 families replay pieces, bitwise equal; dbrx, jetmoe and gemma3n_text are refused at
capture (host reads) and stay eager; 59 take no graphs (state pools, the exact path, DSA indexers).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from families.sweep import PROMPTS
from families.tiny import causal_lm_families, tiny_model

pytestmark = pytest.mark.slow  # every causal LM family twice: a few minutes on 2 cores

MAX_TOKENS = (8, 5, 7)  # requests finish at different steps: sizes 3, 2 and 1 are captured and replayed


def _decode(model: torch.nn.Module, graphs: bool) -> tuple | None:
    """The three prompts' tokens and logprobs, and the engine's decode graphs (None: none taken); None if refused."""
    import nnrun
    from nnrun.exact import ModelRefusedError

    params = [nnrun.SamplingParams(max_tokens=n, temperature=0, logprobs=1, ignore_eos=True) for n in MAX_TOKENS]
    try:
        llm = nnrun.LLM(model, enable_cuda_graphs=graphs, max_num_seqs=4, max_model_len=64)
    except ModelRefusedError:
        return None
    try:
        outputs = llm.generate([list(p) for p in PROMPTS], params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], llm.runner.graph_runner
    finally:
        llm.shutdown()


@pytest.fixture
def capture_at_first_step(monkeypatch):
    """Each batch size captured at its first step that could replay it, however slow the machine."""
    from nnrun import model_runner

    monkeypatch.setattr(model_runner, "CPU_CAPTURE_AFTER", 1)
    monkeypatch.setattr(model_runner, "CPU_CAPTURE_BELOW_S_PER_LAYER", math.inf)


def _eager_then_graphs(model_type: str, run, cannot: str) -> tuple:
    """`run(model, False)` and `run(model, True)` on the family's tiny model; a skip where the first cannot run.

    What nnrun does with a family that cannot run at all is the family sweep's to check (test_family_sweep.py).
    """
    try:
        model = tiny_model(model_type)
    except Exception as error:
        pytest.skip(f"{model_type} cannot be built tiny: {type(error).__name__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            eager = run(model, False)
        except Exception as error:
            pytest.skip(f"{model_type} {cannot} on nnrun: {type(error).__name__}")
        if eager is None:
            pytest.skip(f"{model_type} is refused by name, or has no decoder-layer list")
        return eager, run(model, True)


@pytest.mark.parametrize("model_type", causal_lm_families())
def test_replayed_decode_steps_equal_the_eager_ones_bitwise(model_type, capture_at_first_step):
    eager, (replayed, graphs) = _eager_then_graphs(model_type, _decode, "does not decode")
    assert replayed == eager[0], f"{model_type}: a replayed decode step differs from the eager one"
    if graphs is not None and graphs.refused is None:  # captured: sizes 3, 2 and 1 each replayed
        assert sorted(graphs.replays) == [1, 2, 3], f"{model_type}: captured {sorted(graphs.replays)}"


# ---- decoder-layer pieces of watched decode steps ----------------------------------------------
NUM_WATCHED_STEPS = 6


def _watched(model: torch.nn.Module, pieces: bool):
    """A generation whose every step reads a middle decoder layer's output and steers the next layer's.

    Returns the values read (a step's input is the token the step before chose: equal values at every step mean
    equal tokens) and the engine's pieces (None: none taken); None if refused by name or without decoder layers.
    """
    import nnrun
    from nnrun.exact import ModelRefusedError
    from nnrun.graph_pieces import decoder_layers

    layers = decoder_layers(model)
    if layers is None or len(layers) < 2:
        return None
    path = next(name for name, module in model.named_modules() if module is layers)
    read_at, steer_at = len(layers) // 2 - 1, len(layers) // 2
    try:
        lm = nnrun.LanguageModel(model, max_num_seqs=4, max_model_len=64, cuda_graph_pieces=pieces)
    except ModelRefusedError:
        return None
    envoy_layers = lm
    for part in path.split("."):
        envoy_layers = getattr(envoy_layers, part)
    try:
        with lm.generate(max_new_tokens=NUM_WATCHED_STEPS, min_new_tokens=NUM_WATCHED_STEPS) as tracer:
            read = list().save()
            for prompt in PROMPTS:
                with tracer.invoke(list(prompt)):
                    for _ in tracer.all():
                        read.append(envoy_layers[read_at].output)
                        out = envoy_layers[steer_at].output
                        hidden = out[0] if isinstance(out, (tuple, list)) else out
                        hidden[:] = hidden * 1.5
        return list(read), lm.engine.runner.graph_pieces
    finally:
        lm.shutdown()


def _flat_tensors(values) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [leaf for leaf in tree_flatten(values)[0] if isinstance(leaf, torch.Tensor)]


@pytest.mark.parametrize("model_type", causal_lm_families())
def test_watched_steps_in_pieces_equal_the_eager_ones_bitwise(model_type, capture_at_first_step):
    """Pieces are on by default on CPU: each family's watched decode steps replay the layers no block waits in,
    captured at the first watched step here; every value read equals the all-eager run's."""
    eager, (read, pieces) = _eager_then_graphs(model_type, _watched, "is not traced")
    ours, theirs = _flat_tensors(read), _flat_tensors(eager[0])
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs)), (
        f"{model_type}: a value read in a pieces step differs from the eager step's"
    )
    if pieces is not None and pieces.refused is None:  # captured at the first watched step: the others replay
        assert pieces.num_replays > 0, f"{model_type}: no decoder layer replayed its piece"
