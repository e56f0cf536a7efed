"""Gradients of saved activations and recursive `.source` on nnrun, against nnsight 0.8.1 on plain HF.

`.retain_grad()` on a saved activation followed by `.backward()` (in the trace or after it) must
fill `.grad` with the gradient nnsight gives; recursing into a function an operation calls must
serve that function's operations, in traces and at every generation step. Recursing into the
attention call is refused by name: on nnrun it runs the engine's kernels, not HF's function.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from conformance.compare import assert_same
from conformance.models import bundled_pair, oracle_and_nnrun, tiny_llama, tiny_tokenizer

P = "the cat sat on the mat"
Q = "one two"
ROTARY = "apply_rotary_pos_emb_0"


@pytest.fixture(scope="module")
def pair():
    oracle, ours = oracle_and_nnrun(tiny_llama(seed=11), tiny_tokenizer())
    yield oracle, ours
    ours.shutdown()


@pytest.fixture(scope="module")
def gpt2_pair():
    oracle, ours = bundled_pair("tiny-facts-gpt2")
    yield oracle, ours
    ours.shutdown()


def on_both(pair, fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [fn(model) for model in pair]


# ---- gradients ----------------------------------------------------------------------------
def retained_grad_in_trace(model, prompt=P):
    with model.trace(prompt):
        hidden = model.model.layers[0].output.save()
        hidden.retain_grad()
        model.lm_head.output.sum().backward()
    return hidden.grad


def test_retain_grad_then_backward_in_the_trace(pair):
    expected, actual = on_both(pair, retained_grad_in_trace)
    assert actual is not None and float(actual.abs().sum()) > 0
    assert_same(expected, actual)


def test_retain_grad_on_gpt2_blocks(gpt2_pair):
    def run(model):
        with model.trace("The capital of France is"):
            hidden = model.transformer.h[0].output.save()  # transformers 5: a block returns a tensor
            hidden.retain_grad()
            logits = model.lm_head.output
            (logits[0, -1].logsumexp(-1) - logits[0, -1, 0]).backward()
        return hidden.grad

    expected, actual = on_both(gpt2_pair, run)
    assert actual is not None
    assert_same(expected, actual)


def test_backward_after_the_trace_fills_a_retained_save(pair):
    def run(model):
        with model.trace(P):
            hidden = model.model.layers[1].output.save()
            hidden.retain_grad()
            logits = model.lm_head.output.save()
        logits[0, -1].max().backward()
        return hidden.grad

    expected, actual = on_both(pair, run)
    assert actual is not None
    assert_same(expected, actual)


def test_a_loss_using_the_saved_value_itself_is_counted_once(pair):
    def run(model):
        with model.trace(P):
            hidden = model.model.layers[0].output.save()
            hidden.retain_grad()
            (hidden.pow(2).sum() + model.lm_head.output.sum()).backward()
        return hidden.grad

    expected, actual = on_both(pair, run)
    assert_same(expected, actual)


def test_retain_grad_beside_a_backward_trace(pair):
    def run(model):
        with model.trace(P):
            hidden = model.model.layers[0].output.save()
            hidden.retain_grad()
            loss = model.lm_head.output[0, -1].logsumexp(-1)
            with loss.backward():
                seen = hidden.grad.save()
        return {"seen": seen, "retained": hidden.grad}

    expected, actual = on_both(pair, run)
    assert_same(expected, actual)


def test_retained_grads_of_several_invokes_are_each_prompts_own(pair):
    """nnsight on HF leaves `.grad` None here (its batch views are outside the graph); nnrun fills it
    with the gradient each prompt gets alone, which is what the loss's gradient is (no cross-prompt
    attention)."""
    oracle, ours = pair
    expected = [retained_grad_in_trace(oracle, P), retained_grad_in_trace(oracle, Q)]
    with ours.trace() as tracer:
        with tracer.invoke(P):
            a = ours.model.layers[0].output.save()
            a.retain_grad()
        with tracer.invoke(Q):
            b = ours.model.layers[0].output.save()
            b.retain_grad()
        with tracer.invoke():  # every prompt: the loss sums both
            ours.lm_head.output.sum().backward()
    assert_same(expected, [a.grad, b.grad])


# ---- recursive source ---------------------------------------------------------------------
def test_printed_source_is_hfs(pair):
    oracle, ours = pair
    assert str(ours.model.layers[0].self_attn.source) == str(oracle.model.layers[0].self_attn.source)
    assert str(ours.model.layers[0].self_attn.source.attention_interface_1) == str(
        oracle.model.layers[0].self_attn.source.attention_interface_1
    )


def test_recursive_source_reads_in_a_trace(pair):
    def run(model):
        with model.trace(P):
            rotary = model.model.layers[0].self_attn.source.apply_rotary_pos_emb_0.source
            cos = rotary.cos_0.output.clone().save()
            rotated = rotary.rotate_half_0.output.save()
            query = rotary.q_embed_0.output.clone().save()
            logits = model.lm_head.output.save()
        return {"rotated": rotated, "query": query, "cos": cos, "logits": logits}

    expected, actual = on_both(pair, run)
    assert_same(expected, actual)


def test_recursive_source_at_every_generation_step(pair):
    def run(model):
        with model.generate(P, max_new_tokens=3) as tracer:
            drilled_each_step = list().save()
            for _ in tracer.iter[:3]:
                rotary = model.model.layers[1].self_attn.source.apply_rotary_pos_emb_0.source
                drilled_each_step.append(rotary.q_embed_0.output.clone())
        with model.generate(P, max_new_tokens=3) as tracer:
            drilled_once = list().save()
            rotary = model.model.layers[1].self_attn.source.apply_rotary_pos_emb_0.source
            for _ in tracer.iter[:3]:
                drilled_once.append(rotary.k_embed_0.output.clone())
        return {"each": drilled_each_step, "once": drilled_once}

    expected, actual = on_both(pair, run)
    assert_same(expected, actual)


def test_recursing_into_the_attention_call_is_refused_by_name(pair):
    from nnsight.intervention.source import SourceNotAvailable

    from interleaver.sources import EngineAttentionSourceError

    oracle, ours = pair
    with pytest.raises(EngineAttentionSourceError, match="paged_attention_forward") as raised:
        with ours.trace(P):
            ours.model.layers[0].self_attn.source.attention_interface_1.source
    assert isinstance(raised.value, SourceNotAvailable)
    # The call itself is still served as on HF, and nothing of the refusal stays behind.
    expected, actual = on_both(pair, lambda model: _attention_output(model))
    assert_same(expected, actual)


def _attention_output(model):
    with model.trace(P):
        attended = model.model.layers[0].self_attn.source.attention_interface_1.output[0].save()
    return attended


def test_recursing_into_a_submodule_call_is_refused_as_on_hf(pair):
    def run(model):
        with pytest.raises(Exception) as raised:
            with model.trace(P):
                model.model.layers[0].self_attn.source.self_q_proj_0.source
        return type(raised.value), str(raised.value)

    expected, actual = on_both(pair, run)
    assert actual == expected


def test_recursive_source_outside_a_trace_raises_as_on_hf(pair):
    def run(model):
        with pytest.raises(Exception) as raised:
            model.model.layers[0].self_attn.source.apply_rotary_pos_emb_0.source
        return type(raised.value), str(raised.value)

    expected, actual = on_both(pair, run)
    assert actual == expected


def test_a_kept_drilled_copy_stops_standing_in_once_the_call_changes():
    from interleaver.sources import forget_if_other_callable

    def first(x):
        return x

    def second(x):
        return x

    sourced = {"op": (first, None)}
    forget_if_other_callable(sourced, "op", first)
    assert sourced["op"] is not None
    forget_if_other_callable(sourced, "op", second)
    assert sourced["op"] is None


# ---- head-first values inside `.source`, with other requests in the step ---------------------
LONG = "the cat sat on the mat in the garden"  # longest: HF's batch pads the other invoke to it
SHORT = "one two"


def _query_states(model, edit_short=False):
    with model.trace() as tracer:
        with tracer.invoke(LONG):
            long_q = model.model.layers[0].self_attn.source.query_states_0.output.save()  # [1, H, T, D]
            long_logits = model.lm_head.output.save()
        with tracer.invoke(SHORT):
            short_q = model.model.layers[0].self_attn.source.query_states_0.output
            if edit_short:
                short_q[:] = 0  # in place, on this request's tokens only
            short_q = short_q.save()
    return long_q, short_q, long_logits


def test_head_first_source_values_are_each_requests_own(pair):
    oracle, ours = pair
    (hf_long, hf_short, _), (long_q, short_q, _) = on_both(pair, _query_states)
    assert_same(hf_long, long_q)
    n = len(SHORT.split())
    assert short_q.shape == (*hf_short.shape[:2], n, hf_short.shape[3])  # its own tokens, not the whole step's
    assert_same(hf_short[:, :, -n:], short_q)  # HF left-pads it to the batch; its real tokens are the same


def test_an_in_place_edit_of_a_head_first_value_stays_in_its_request(pair):
    _, ours = pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, clean_short, clean_logits = _query_states(ours)
        _, edited_short, edited_logits = _query_states(ours, edit_short=True)
    assert edited_short.abs().sum() == 0 and clean_short.abs().sum() > 0
    assert torch.equal(clean_logits, edited_logits)  # the other invoke's request is untouched


def test_a_head_first_value_whose_token_dim_is_ambiguous_is_refused(pair):
    from interleaver.batcher import AmbiguousLayoutError

    _, ours = pair
    heads = ours.config.num_attention_heads  # 4: two invokes of 2 tokens make a step of 4 tokens
    with pytest.raises(AmbiguousLayoutError, match="query_states_0"):
        with ours.trace() as tracer:
            with tracer.invoke("one two"):
                ours.model.layers[0].self_attn.source.query_states_0.output.save()
            with tracer.invoke("three four"):
                pass
    assert heads == 4
    with ours.trace("one two three four"):  # one request alone: nothing to tell apart
        alone = ours.model.layers[0].self_attn.source.query_states_0.output.save()
    assert alone.shape[2] == 4
