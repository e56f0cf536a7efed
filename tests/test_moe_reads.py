"""MoE values laid out by token (`[N, ...]`: HF's router logits and experts' inputs) are each request's own.

HF's MoE blocks flatten the step's tokens (`hidden_states.view(-1, hidden)`) before routing, so in a
packed step a router's logits or the experts' input hold every request's tokens. An invoke must read
and write only its prompt's rows; the oracle is plain HF run on that prompt alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

import nnrun
from conformance.models import tiny_tokenizer, twin
from tolerance import assert_close_packed

SHORT, LONG = "the cat sat", "on the mat in the park"


@pytest.fixture(scope="module")
def mixtral():
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        eos_token_id=None,
    )
    model = MixtralForCausalLM(config).eval()
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer)
    yield ours, twin(model), tokenizer
    ours.shutdown()


@torch.no_grad()
def hf_alone(oracle, tokenizer, prompt: str, zero_experts_input: bool = False) -> dict:
    """One prompt through plain HF: layer 0's router logits, experts' input, and the last logits."""
    seen = {}
    mlp = oracle.model.layers[0].mlp

    def gate_hook(module, args, output):
        seen["router"] = output[0].clone()

    def experts_pre_hook(module, args, kwargs):
        seen["experts_in"] = args[0].clone()
        if zero_experts_input:
            return (torch.zeros_like(args[0]), *args[1:]), kwargs
        return None

    handles = [
        mlp.gate.register_forward_hook(gate_hook),
        mlp.experts.register_forward_pre_hook(experts_pre_hook, with_kwargs=True),
    ]
    try:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        seen["logits"] = oracle(ids).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_each_invoke_reads_its_own_router_logits_and_experts_input(mixtral):
    ours, oracle, tokenizer = mixtral
    with ours.trace() as tracer:
        with tracer.invoke(SHORT):
            router_a = ours.model.layers[0].mlp.gate.output[0].save()
            experts_a = ours.model.layers[0].mlp.experts.input.save()
        with tracer.invoke(LONG):
            router_b = ours.model.layers[0].mlp.gate.output[0].save()
    for router, experts, prompt in ((router_a, experts_a, SHORT), (router_b, None, LONG)):
        expected = hf_alone(oracle, tokenizer, prompt)
        assert router.shape == expected["router"].shape  # [T, experts]: this prompt's tokens only
        assert_close_packed(router, expected["router"], msg=f"router logits of {prompt!r}")
        if experts is not None:
            assert_close_packed(experts, expected["experts_in"], msg=f"experts' input of {prompt!r}")


def test_an_invoke_of_several_prompts_reads_their_rows_in_order(mixtral):
    ours, oracle, tokenizer = mixtral
    with ours.trace() as tracer:
        with tracer.invoke([SHORT, LONG]):
            router = ours.model.layers[0].mlp.gate.output[0].save()
    expected = torch.cat([hf_alone(oracle, tokenizer, prompt)["router"] for prompt in (SHORT, LONG)])
    assert_close_packed(router, expected, msg="router logits of both prompts, in order")


def test_an_edit_of_the_experts_input_stays_in_its_request(mixtral):
    ours, oracle, tokenizer = mixtral
    with ours.trace() as tracer:
        with tracer.invoke(SHORT):
            ours.model.layers[0].mlp.experts.input[:] = 0
            edited = ours.lm_head.output[0, -1].save()
        with tracer.invoke(LONG):
            innocent = ours.lm_head.output[0, -1].save()
    assert_close_packed(edited, hf_alone(oracle, tokenizer, SHORT, zero_experts_input=True)["logits"])
    assert_close_packed(innocent, hf_alone(oracle, tokenizer, LONG)["logits"])
    assert not torch.allclose(edited, hf_alone(oracle, tokenizer, SHORT)["logits"])  # the edit did bind
