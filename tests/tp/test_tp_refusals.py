"""What tensor parallelism refuses at load, by name, before any rank process starts."""

import pytest
import torch

import nnrun
from nnrun import LLM
from nnrun.config import EngineConfig

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("value", [0, -2, "2", True, 1.5])
def test_tensor_parallel_size_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig.from_kwargs("tiny-facts", tensor_parallel_size=value)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_timeout must be positive"):
        EngineConfig.from_kwargs("tiny-facts", tensor_parallel_timeout=0)


def test_a_model_without_a_plan_is_refused():
    # GPT-2 has no `base_model_tp_plan` in transformers
    with pytest.raises(ValueError, match="GPT2LMHeadModel .*has no tensor-parallel plan"):
        LLM("tiny-facts-gpt2", tensor_parallel_size=2)


def test_heads_that_do_not_divide_are_refused_with_the_sizes_that_work():
    # tiny-facts: 4 attention heads, 2 KV heads, MLP 512, vocabulary 768
    with pytest.raises(
        ValueError,
        match=r"does not divide LlamaForCausalLM's attention heads \(num_attention_heads=4\)"
        r".*: 1, 2$",
    ):
        LLM("tiny-facts", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"KV heads \(num_key_value_heads=2\).*: 1, 2$"):
        LLM("tiny-facts", tensor_parallel_size=4)


def test_sources_without_a_checkpoint_are_refused():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(nnrun.bundled_model_path("tiny-facts"), dtype=torch.float32)
    with pytest.raises(ValueError, match="in-memory LlamaForCausalLM. Save it first"):
        LLM(model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="load_format='dummy' is not supported"):
        LLM("tiny-facts", tensor_parallel_size=2, load_format="dummy")


def test_a_runner_without_a_tensor_parallel_front_end_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="NNsightGPUModelRunner .*not served on tensor-parallel ranks"):
        from interleaver.runner import NNsightGPUModelRunner

        LLM("tiny-facts", tensor_parallel_size=2, runner_cls=NNsightGPUModelRunner)


def test_devices_other_than_cpu_or_all_gpus_are_refused():
    with pytest.raises(ValueError, match="runs on device='cpu' or device='cuda'"):
        LLM("tiny-facts", tensor_parallel_size=2, device="mps")


def test_a_checkpoint_that_does_not_exist_is_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(ValueError, match="could not load model .*not a local checkpoint folder"):
        LLM(str(tmp_path / "missing"), tensor_parallel_size=2)
