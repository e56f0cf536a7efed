"""The tensor-parallel code path on CUDA with one rank (NCCL), against the one-process engine and nnsight on HF.

A machine with one GPU cannot hold two ranks, but one rank runs the whole rank path: the front end,
the spawned rank process, NCCL's process group, the step wire, rank 0's sampler and (in bf16 with
head dim 64) FlashInfer on the rank. Skipped without CUDA.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from conformance.compare import assert_scenario_same
from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer, twin
from conformance.scenarios import SCENARIOS

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


def test_one_nccl_rank_gives_the_one_process_engines_tokens(bf16_checkpoint):
    import nnrun
    from nnrun.tp import TensorParallelRunner

    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 9)]
    params = nnrun.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    options = dict(device="cuda", dtype=torch.bfloat16)
    with nnrun.LLM(bf16_checkpoint, **options) as plain:
        want = plain.generate(prompts, params)
        backend = plain.runner.attn_backend.name
    with nnrun.LLM(bf16_checkpoint, runner_cls=TensorParallelRunner, **options) as one_rank:
        got = one_rank.generate(prompts, params)
    print(f"one-process attention backend: {backend}")
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
