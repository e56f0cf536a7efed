"""TP=2 against one rank and against plain HF on other families: GQA with q/k norms, a sliding window, MoE."""

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from model_zoo import make_model
from nnrun import LLM, SamplingParams

pytestmark = pytest.mark.slow

# Long enough to cross Mistral's 24-token window; two shapes so the packed step has two groups.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 5, [3, 4, 5]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0)
# Two ranks sum the row-parallel projections in halves: fp32 summation order (observed <= 5e-7 here).
RTOL, ATOL = 1e-5, 1e-5


def _mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=512,
        )
    ).eval()


BUILDERS = {"qwen3": lambda: make_model("qwen3"), "mistral": lambda: make_model("mistral"), "mixtral": _mixtral}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_two_ranks_match_one_rank_and_plain_hf(family, tmp_path):
    hf = BUILDERS[family]()
    hf.set_attn_implementation("sdpa")
    hf.save_pretrained(tmp_path)
    with torch.no_grad():  # the oracle: plain HF's log-probabilities of each prompt's next tokens
        expected = [
            hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
            for ids in PROMPTS
        ]
    tp2 = LLM(str(tmp_path), tensor_parallel_size=2, tensor_parallel_timeout=60)
    try:
        ours = tp2.generate(PROMPTS, GREEDY)
    finally:
        assert tp2.shutdown(timeout=30)
    one = LLM(str(tmp_path))
    theirs = one.generate(PROMPTS, GREEDY)
    one.shutdown()
    for ids, a, b, oracle in zip(PROMPTS, ours, theirs, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        prompt_lps = torch.tensor([entry[token] for entry, token in zip(a.prompt_logprobs[1:], ids[1:])])
        torch.testing.assert_close(prompt_lps, oracle, rtol=RTOL, atol=ATOL)


def _trace(model, edit: bool) -> dict:
    """Reads of the residual stream and an MLP (MoE block) output, and an edit in the second invoke."""
    with model.trace() as tracer:
        with tracer.invoke([PROMPTS[0]]):
            hidden = model.model.layers[0].output[:, -1].save()
            mlp = model.model.layers[1].mlp.output[:, -1].save()
        with tracer.invoke([PROMPTS[1]]):
            if edit:
                model.model.layers[0].output[:, -1] *= 0.5
            logits = model.lm_head.output[:, -1].save()
    return {"hidden": hidden, "mlp": mlp, "logits": logits}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_traces_on_two_ranks_match_one_rank_and_plain_hf(family, tmp_path):
    import nnrun
    from tolerance import assert_close_packed

    hf = BUILDERS[family]()
    hf.set_attn_implementation("sdpa")
    hf.save_pretrained(tmp_path)
    with torch.no_grad():  # plain HF: the first layer's output at the first prompt's last position
        expected_hidden = hf(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states[1][:, -1]
    tp2 = nnrun.LanguageModel(str(tmp_path), tensor_parallel_size=2, tensor_parallel_timeout=60)
    try:
        ours = _trace(tp2, edit=True)
    finally:
        tp2.shutdown()
    one = nnrun.LanguageModel(str(tmp_path))
    try:
        theirs = _trace(one, edit=True)
    finally:
        one.shutdown()
    assert_close_packed(ours["hidden"], expected_hidden, msg=f"{family}: layer 0 vs plain HF")
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, name
        assert_close_packed(ours[name], theirs[name], msg=f"{family}: {name} vs one rank")
