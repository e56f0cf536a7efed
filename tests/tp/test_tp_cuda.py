"""The tensor-parallel code path on CUDA with one rank (NCCL), against the one-process engine and nnsight on HF.

A machine with one GPU cannot hold two ranks, but one rank runs the whole rank path: the front end,
the spawned rank process, NCCL's process group, the step wire, rank 0's sampler and (in bf16 with
head dim 64) FlashInfer on the rank, with decode CUDA graphs captured around NCCL's collectives.
Skipped without CUDA.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from conformance.compare import assert_scenario_same
from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin
from conformance.scenarios import SCENARIOS
from nnrun.forward_batch import ForwardMode
from nnrun.tp import TensorParallelRunner
from nnrun.tp.worker import ShardRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama-hd64")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


class CountingShardRunner(ShardRunner):
    """The shard runner, counting its decode steps that replayed a CUDA graph (a `replayed` exchange answers)."""

    replayed = 0

    def run_model(self, forward_batch):
        if forward_batch.forward_mode is ForwardMode.DECODE and self._replays_graph(forward_batch):
            self.replayed += 1
        return super().run_model(forward_batch)

    def serve_exchange(self, message: dict) -> bytes | None:
        if message["op"] != "replayed":
            return super().serve_exchange(message)
        return pickle.dumps(self.replayed)


class CountingTensorParallelRunner(TensorParallelRunner):
    rank_runner = f"{__name__}:CountingShardRunner"


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_one_nccl_rank_gives_the_one_process_engines_tokens(bf16_checkpoint, graphs):
    """With graphs, the rank captures them with NCCL's collectives inside and replays every decode step.

    Rows end at different lengths: batches of 4, 3 (the graph of 4, padded), 2 and 1.
    """
    import nnrun

    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 9)]
    params = [nnrun.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1) for n in (12, 4, 7, 2)]
    options = dict(device="cuda", dtype=torch.bfloat16, enable_cuda_graphs=graphs)
    with nnrun.LLM(bf16_checkpoint, **options) as plain:
        want = plain.generate(prompts, params)
        backend = plain.runner.attn_backend.name
        graph_runner = plain.runner.graph_runner
    print(f"one-process attention backend: {backend}")
    if graphs and graph_runner is None:
        pytest.skip(f"the one-process engine captured no CUDA graphs here (attention backend: {backend})")
    with nnrun.LLM(
        bf16_checkpoint, runner_cls=CountingTensorParallelRunner, tensor_parallel_cuda_graphs=graphs, **options
    ) as one_rank:
        assert one_rank.runner.rank_graph_batch_sizes == (graph_runner.batch_sizes if graphs else None)
        got = one_rank.generate(prompts, params)
        with one_rank.runner.step_lock:
            replayed = pickle.loads(one_rank.runner.group.exchange(pickle.dumps({"op": "replayed"})))
    assert replayed == (max(p.max_tokens for p in params) - 1 if graphs else 0)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


@pytest.fixture(scope="module")
def nnsight_on_one_rank(tmp_path_factory, request):
    import interleaver.model as model_module
    import nnrun

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = tiny_tokenizer()
    model = tiny_llama()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    oracle = hf_language_model(twin(model).to("cuda"), tokenizer)
    # LanguageModel takes the rank path only for N > 1; the same front end runs one rank here.
    patch = pytest.MonkeyPatch()
    patch.setattr(model_module, "NNsightGPUModelRunner", model_module.TensorParallelNNsightRunner)
    try:
        ours = nnrun.LanguageModel(str(folder), device="cuda", dtype=torch.float32, tensor_parallel_timeout=120)
    finally:
        patch.undo()
    model_module.tag_envoys(ours)
    yield oracle, ours, tokenizer
    ours.shutdown()


@pytest.mark.parametrize("name", sorted(set(SCENARIOS) - {"gradient_of_loss"}))  # gradients: refused on ranks
def test_nnsight_scenarios_on_one_nccl_rank_match_nnsight_on_hf(nnsight_on_one_rank, name):
    oracle, ours, tokenizer = nnsight_on_one_rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            assert_scenario_same(name, oracle, ours, tokenizer)
        except RuntimeError as error:
            if "device" in str(error):
                pytest.skip(f"the scenario's own tensors are on the CPU: {error}")
            raise
