"""Config validation names the field; the loader takes every kind of model source."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nnrun
from model_zoo import hf_logits, make_model, make_twin, random_prompts
from nnrun.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: CacheConfig(page_size=0), "CacheConfig.page_size"),
        (lambda: CacheConfig(max_total_tokens=-1), "CacheConfig.max_total_tokens"),
        (lambda: CacheConfig(gpu_memory_utilization=1.5), "CacheConfig.gpu_memory_utilization"),
        (lambda: SchedulerConfig(max_num_seqs=0), "SchedulerConfig.max_num_seqs"),
        (lambda: SchedulerConfig(max_num_batched_tokens=0), "SchedulerConfig.max_num_batched_tokens"),
        (lambda: DeviceConfig(device="tpu"), "DeviceConfig.device"),
        (lambda: DeviceConfig(dtype="float64"), "dtype"),
        (lambda: EngineConfig.from_kwargs("m", page_sise=4), "page_sise"),
        (lambda: EngineConfig.from_kwargs("m", load_format="gguf"), "ModelConfig.load_format"),
    ],
)
def test_config_errors_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_engine_kwargs_reach_their_config():
    config = EngineConfig.from_kwargs("m", page_size=8, max_num_seqs=3, max_model_len=64)
    assert (config.cache.page_size, config.scheduler.max_num_seqs, config.model.max_model_len) == (8, 3, 64)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_model("llama", seed=5).save_pretrained(path)  # dummy weights use seed 0: these must differ
    return path


def test_load_from_checkpoint_folder(checkpoint_dir):
    oracle = LlamaForCausalLM.from_pretrained(checkpoint_dir).eval()
    prompt = random_prompts([12])[0]
    with nnrun.LLM(str(checkpoint_dir)) as llm:
        out = llm.generate([prompt], nnrun.SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
    token = out.outputs[0].token_ids[0]
    expected = torch.log_softmax(hf_logits(oracle, prompt)[-1], -1)
    assert token == expected.argmax().item()
    assert abs(out.outputs[0].logprobs[0][token] - expected[token].item()) < 1e-4


def test_dummy_weights_take_the_checkpoint_shapes(checkpoint_dir):
    with nnrun.LLM(str(checkpoint_dir), load_format="dummy") as llm:
        real = LlamaForCausalLM.from_pretrained(checkpoint_dir)
        assert [p.shape for p in llm.model.parameters()] == [p.shape for p in real.parameters()]
        assert not torch.equal(llm.model.lm_head.weight, real.lm_head.weight)
        assert len(llm.generate([[1, 2, 3]], nnrun.SamplingParams(max_tokens=2))[0].outputs[0].token_ids) >= 1


def test_dummy_from_a_config_object():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with nnrun.LLM(config, load_format="dummy", dtype="bfloat16") as llm:
        assert llm.model.dtype == torch.bfloat16 and llm.runner.kv_pool.k_pages[0].dtype == torch.bfloat16


def test_unknown_hub_id_offline_is_a_clear_error():
    with pytest.raises(ValueError, match="not a local checkpoint folder, not a bundled model"):
        nnrun.LLM("no-such-org/no-such-model")


@pytest.mark.slow  # starts a fresh interpreter
def test_hub_id_loads_from_the_local_hub_cache(checkpoint_dir, tmp_path):
    """A hub id resolves offline when the HF cache holds it (laid out as huggingface_hub does)."""
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for file in os.listdir(checkpoint_dir):
        (snapshot / file).symlink_to(checkpoint_dir / file)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    script = textwrap.dedent("""
        import nnrun
        llm = nnrun.LLM("acme/tiny")
        print(type(llm.model).__name__, llm.runner.model_name)
        llm.shutdown()
    """)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LlamaForCausalLM acme/tiny" in done.stdout


def test_dynamic_rope_runs_on_the_exact_path_with_the_reason():
    """Its frequencies depend on the longest position in a batch: each request runs through HF's own forward."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompts = [list(range(3, 23)), [5, 6, 7]]
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    with nnrun.LLM(model) as llm:
        assert "rope_type='dynamic'" in llm.runner.exact_forward.reason
        outputs = llm.generate(prompts, nnrun.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_in_memory_model_stays_usable_as_plain_hf():
    model = make_model("qwen2")
    oracle = make_twin(model)
    prompt = random_prompts([40])[0]
    with nnrun.LLM(model) as llm:
        llm.generate([prompt], nnrun.SamplingParams(max_tokens=2))
        batch = torch.tensor([prompt, prompt])
        mask = torch.ones_like(batch)
        mask[1, :5] = 0  # a padded row: the mask must still apply outside the engine
        with torch.no_grad():
            got = model(batch, attention_mask=mask).logits
            want = oracle(batch, attention_mask=mask).logits
    assert torch.allclose(got[0], want[0], atol=1e-4)
    assert torch.allclose(got[1, 5:], want[1, 5:], atol=1e-4)  # padded positions are garbage in any HF backend


def test_dummy_from_a_config_leaves_the_callers_config_alone():
    """Regression: a shared config let a later HF model switch the engine's attention to plain sdpa."""
    from nnrun.attention import ATTN_IMPLEMENTATION

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with nnrun.LLM(config, load_format="dummy") as llm:
        assert config._attn_implementation != ATTN_IMPLEMENTATION
        LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
        assert llm.model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_engine_restores_its_attention_if_the_user_switches_it():
    model = make_model("llama")
    oracle = make_twin(model)
    prompt = random_prompts([30])[0]
    with nnrun.LLM(model) as llm:
        model.set_attn_implementation("sdpa")  # e.g. a user preparing the same model for plain HF
        out = llm.generate([prompt], nnrun.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    ids = torch.tensor([prompt])
    expected = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
