"""The forward path (`nnrun/forward_path.py`): chosen once per model at load; the runner and its callers ask it.

A plain Llama gets the packed path (and decode graphs where the backend takes them), a model that must
go exact the exact path, a state-space model the packed path with its state pool and no graphs. Each
generates HF's own greedy tokens, and the path chosen at load serves every step: no step chooses again.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import nnrun
import nnrun.model_runner as model_runner
from conformance.models import twin
from fake_cuda_graph import RecordingCapturer
from fake_flashinfer import make_fake_flashinfer
from families.tiny import tiny_model
from model_zoo import make_model
from nnrun import SamplingParams
from nnrun.exact import FORCED_REASON
from nnrun.forward_path import ExactPath, PackedPath
from test_flashinfer_emulated import use_flashinfer

NUM_TOKENS = 4
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
PROMPTS = [[17, 33, 45, 58, 61], [101, 42, 13], [20, 71, 82, 93, 24, 35, 46]]  # within every tiny vocabulary


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """Plain HF, this prompt alone, the whole sequence each step (no cache)."""
    ids = list(prompt)
    for _ in range(NUM_TOKENS):
        ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def tokens_of(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture
def choices(monkeypatch) -> list:
    """The `packed_unfit` reason of each path choice the runner makes (each call of the probe)."""
    calls: list = []
    probe = model_runner.choose_exact_forward
    monkeypatch.setattr(
        model_runner,
        "choose_exact_forward",
        lambda runner, packed, unfit: calls.append(unfit) or probe(runner, packed, unfit),
    )
    return calls


def test_a_plain_llama_runs_packed_with_decode_graphs_chosen_once(choices, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", make_fake_flashinfer())
    model = make_model("llama")
    oracle = twin(model)
    with nnrun.LLM(model, max_num_seqs=4) as llm:
        runner, path = llm.runner, llm.runner.path
        assert type(path) is PackedPath and path.packs_requests and path.takes_graphs and path.reason is None
        assert runner.exact_forward is None and runner.state_pool is None and runner.indexer_keys is None
        use_flashinfer(llm)
        runner.config.device.cuda_graph_batch_sizes = [1, 2, 4]
        capturer = RecordingCapturer()
        runner.init_cuda_graphs(capturer=capturer)
        assert runner.graph_runner is path.graphs is not None and capturer.captures == 3
        outputs = llm.generate(PROMPTS, GREEDY)
        assert runner.path is path and capturer.replays > 0  # decode steps replayed the packed path's graphs
    assert choices == [None]  # one probe, at load
    assert tokens_of(outputs) == [hf_greedy(oracle, prompt) for prompt in PROMPTS]


def test_a_model_that_must_go_exact_gets_the_exact_path(choices):
    model = make_model("llama")
    oracle = twin(model)
    with nnrun.LLM(model, forward_path="exact", max_num_seqs=4) as llm:
        runner, path = llm.runner, llm.runner.path
        assert type(path) is ExactPath and not path.packs_requests and not path.takes_graphs
        assert path.reason == FORCED_REASON and runner.exact_forward is path.hf and runner.layers == []
        runner.init_cuda_graphs(capturer=RecordingCapturer())
        assert runner.graph_runner is None
        outputs = llm.generate(PROMPTS, GREEDY)
        assert runner.path is path
        with pytest.raises(ValueError, match="takes one prompt at a time there"):
            runner.run_prefill_only(PROMPTS[:2])
    assert choices == [FORCED_REASON]
    assert tokens_of(outputs) == [hf_greedy(oracle, prompt) for prompt in PROMPTS]


@pytest.mark.parametrize("model_type", ["mamba", "qwen3_next"])
def test_a_state_space_model_runs_packed_over_its_state_pool_without_graphs(choices, model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type)
        oracle = twin(model)
        with nnrun.LLM(model, max_num_seqs=4, max_model_len=64) as llm:
            runner, path = llm.runner, llm.runner.path
            assert type(path) is PackedPath and path.packs_requests and runner.exact_forward is None
            assert runner.state_pool is path.state_pool is not None
            assert not path.takes_graphs  # a replay would not run the mixers' per-request Python
            capturer = RecordingCapturer()
            runner.init_cuda_graphs(capturer=capturer)
            assert runner.graph_runner is None and capturer.captures == 0
            outputs = llm.generate(PROMPTS, GREEDY)
            assert runner.path is path
        expected = [hf_greedy(oracle, prompt) for prompt in PROMPTS]
    assert choices == [None]
    assert tokens_of(outputs) == expected
