"""Every causal LM family's CPU decode graphs (nnrun/traced_graph.py) against its eager steps, bitwise (make test-all).

Decode graphs are on by default on CPU: a family's unwatched decode steps replay traced pieces around
eager attention once a batch size is captured. The oracle is the same engine with graphs off. Each
family captures at its first decode step here (`CPU_CAPTURE_AFTER` 1) and decodes 3 prompts for 8
steps, the batch shrinking as they finish; tokens and logprobs must be bitwise equal. A family whose
capture is refused (a host read in its forward) decodes eagerly and must still be equal; the refusal
is allowed, a difference is not.
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


def _decode(model: torch.nn.Module, graphs: bool):
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


@pytest.mark.parametrize("model_type", causal_lm_families())
def test_replayed_decode_steps_equal_the_eager_ones_bitwise(model_type, monkeypatch):
    from nnrun import model_runner

    monkeypatch.setattr(model_runner, "CPU_CAPTURE_AFTER", 1)
    monkeypatch.setattr(model_runner, "CPU_CAPTURE_BELOW_S_PER_LAYER", math.inf)  # however slow the machine
    try:
        model = tiny_model(model_type)
    except Exception as error:  # the family sweep (test_family_sweep.py) says why it cannot be built
        pytest.skip(f"{model_type} cannot be built tiny: {type(error).__name__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            eager = _decode(model, graphs=False)
        except Exception as error:  # the family sweep checks what nnrun does with it
            pytest.skip(f"{model_type} does not decode on nnrun: {type(error).__name__}")
        if eager is None:
            pytest.skip(f"{model_type} is refused by name")
        replayed, graphs = _decode(model, graphs=True)
    assert replayed == eager[0], f"{model_type}: a replayed decode step differs from the eager one"
    if graphs is not None and graphs.refused is None:  # captured: sizes 3, 2 and 1 each replayed
        assert sorted(graphs.replays) == [1, 2, 3], f"{model_type}: captured {sorted(graphs.replays)}"
