"""nnsight scenarios written once, run on nnsight-on-HF and on nnrun.LanguageModel alike.

Each scenario takes a model object (`nnsight.LanguageModel` or `nnrun.LanguageModel` over the same
weights) and returns its saved values. Values whose rows HF left-pads to the batch's longest prompt
come back as `Padded(value, lengths)`: only the trailing real tokens of each row are compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

SCENARIOS: dict[str, Callable[[Any, Any], dict]] = {}

A = "the eiffel tower is in the city of"  # 8 tokens
B = "the colosseum is in"  # 4 tokens
C = "big ben is located in the city"  # 7 tokens
D = "mary gave john the milk and the"  # 7 tokens
E = "john gave mary the book and the"  # 7 tokens


@dataclass
class Padded:
    """A saved batch value of prompts with these lengths: compare each row's last `lengths[i]` positions."""

    value: Any
    lengths: list[int]


def scenario(fn: Callable) -> Callable:
    SCENARIOS[fn.__name__] = fn
    return fn


def n_tokens(tok, text: str) -> int:
    return len(tok(text)["input_ids"])


def next_token(model: Any) -> Any:
    """The token sampled this step: nnrun serves `model.samples`; on HF greedy decoding's argmax is it."""
    if hasattr(type(model), "samples"):
        return model.samples
    return model.lm_head.output[:, -1].argmax(dim=-1)


# ---- reading ------------------------------------------------------------------------------
@scenario
def save_layer_outputs(model, tok):
    with model.trace(A):
        h0 = model.model.layers[0].output.save()
        h2 = model.model.layers[2].output.save()
    return {"h0": h0, "h2": h2}


@scenario
def save_layer_inputs(model, tok):
    with model.trace(A):
        x1 = model.model.layers[1].input.save()
        n1 = model.model.layers[1].post_attention_layernorm.input.save()
    return {"x1": x1, "n1": n1}


@scenario
def logits_and_prediction(model, tok):
    with model.trace(C):
        logits = model.lm_head.output.save()
        prediction = model.lm_head.output[0, -1].argmax(dim=-1).save()
    return {"logits": logits, "prediction": prediction}


@scenario
def model_output_and_result(model, tok):
    with model.trace(B) as tracer:
        out = model.output.logits.save()
        result = tracer.result.logits.save()
    return {"out": out, "result": result}


@scenario
def embeddings_and_norm(model, tok):
    with model.trace(D):
        emb = model.model.embed_tokens.output.save()
        final = model.model.norm.output.save()
    return {"emb": emb, "final": final}


@scenario
def qkv_projections(model, tok):
    with model.trace(A):
        attn = model.model.layers[1].self_attn
        q = attn.q_proj.output.save()
        k = attn.k_proj.output.save()
        v = attn.v_proj.output.save()
    return {"q": q, "k": k, "v": v}


@scenario
def attention_module_output(model, tok):
    with model.trace(C):
        attn_out = model.model.layers[0].self_attn.output[0].save()
        o_proj_in = model.model.layers[2].self_attn.o_proj.input.save()
    return {"attn_out": attn_out, "o_proj_in": o_proj_in}


@scenario
def mlp_internals(model, tok):
    with model.trace(B):
        mlp = model.model.layers[2].mlp
        gate = mlp.gate_proj.output.save()
        act = mlp.act_fn.output.save()
        down_in = mlp.down_proj.input.save()
    return {"gate": gate, "act": act, "down_in": down_in}


@scenario
def source_attention_interface(model, tok):
    with model.trace(D):
        attended = model.model.layers[1].self_attn.source.attention_interface_1.output[0].save()
    return {"attended": attended}


@scenario
def cache_modules(model, tok):
    with model.trace(C) as tracer:
        cache = tracer.cache(modules=[model.model.layers[0], model.model.layers[2].mlp])
    return {"layer0": cache["model.model.layers.0"].output, "mlp2": cache["model.model.layers.2.mlp"].output}


@scenario
def direct_list_input(model, tok):
    with model.trace([A, B]):
        hidden = model.model.layers[0].output.save()
        logits = model.lm_head.output.save()
    lengths = [n_tokens(tok, A), n_tokens(tok, B)]
    return {"hidden": Padded(hidden, lengths), "logits": Padded(logits, lengths)}


# ---- editing ------------------------------------------------------------------------------
@scenario
def zero_mlp(model, tok):
    with model.trace(A):
        model.model.layers[1].mlp.output[:] = 0
        h1 = model.model.layers[1].output.save()
        logits = model.lm_head.output.save()
    return {"h1": h1, "logits": logits}


@scenario
def clone_before_edit(model, tok):
    with model.trace(C):
        before = model.model.layers[0].output.clone().save()
        model.model.layers[0].output[:, -2:] = 0
        after = model.model.layers[0].output.save()
        logits = model.lm_head.output.save()
    return {"before": before, "after": after, "logits": logits}


@scenario
def assign_output(model, tok):
    with model.trace(D):
        h0 = model.model.layers[0].output
        model.model.layers[0].output = h0 * 2
        kept = h0.save()
        h1 = model.model.layers[1].output.save()
        logits = model.lm_head.output.save()
    return {"kept": kept, "h1": h1, "logits": logits}


@scenario
def assign_input(model, tok):
    with model.trace(B):
        x = model.model.layers[2].input
        model.model.layers[2].input = x + 1.0
        seen = model.model.layers[2].mlp.input.save()
        logits = model.lm_head.output.save()
    return {"seen": seen, "logits": logits}


@scenario
def edit_embeddings_in_place(model, tok):
    with model.trace(A):
        model.model.embed_tokens.output[:, 1] = 0
        logits = model.lm_head.output.save()
    return {"logits": logits}


@scenario
def skip_layer(model, tok):
    with model.trace(C):
        layer = model.model.layers[1]
        layer.skip(layer.input)
        h1 = layer.output.save()
        logits = model.lm_head.output.save()
    return {"h1": h1, "logits": logits}


@scenario
def skip_mlp(model, tok):
    with model.trace(D):
        mlp = model.model.layers[0].mlp
        mlp.skip(torch.zeros_like(mlp.input))
        h0 = model.model.layers[0].output.save()
        logits = model.lm_head.output.save()
    return {"h0": h0, "logits": logits}


@scenario
def stop_early(model, tok):
    with model.trace(B) as tracer:
        h0 = model.model.layers[0].output.save()
        tracer.stop()
    return {"h0": h0}


# ---- several invokes ----------------------------------------------------------------------
@scenario
def invokes_of_different_lengths(model, tok):
    with model.trace() as tracer:
        with tracer.invoke(A):
            a = model.model.layers[1].output.save()
            la = model.lm_head.output.save()
        with tracer.invoke(B):
            b = model.model.layers[1].output.save()
            lb = model.lm_head.output.save()
        with tracer.invoke(C):
            c = model.model.layers[1].output.save()
    na, nb, nc = n_tokens(tok, A), n_tokens(tok, B), n_tokens(tok, C)
    return {
        "a": Padded(a, [na]),
        "la": Padded(la, [na]),
        "b": Padded(b, [nb]),
        "lb": Padded(lb, [nb]),
        "c": Padded(c, [nc]),
    }


@scenario
def empty_invoke(model, tok):
    with model.trace() as tracer:
        with tracer.invoke(A):
            a = model.model.layers[0].output.save()
        with tracer.invoke(B):
            model.model.layers[0].output[:] = 0
        with tracer.invoke():
            everything = model.model.layers[0].output.save()
            logits = model.lm_head.output.save()
    lengths = [n_tokens(tok, A), n_tokens(tok, B)]
    return {"a": Padded(a, lengths[:1]), "everything": Padded(everything, lengths), "logits": Padded(logits, lengths)}


@scenario
def list_invoke(model, tok):
    with model.trace() as tracer:
        with tracer.invoke([B, C]):
            h = model.model.layers[2].output.save()
            logits = model.lm_head.output.save()
        with tracer.invoke(A):
            a = model.model.layers[2].output.save()
    lengths = [n_tokens(tok, B), n_tokens(tok, C)]
    return {"h": Padded(h, lengths), "logits": Padded(logits, lengths), "a": Padded(a, [n_tokens(tok, A)])}


@scenario
def list_invoke_edit(model, tok):
    with model.trace() as tracer:
        with tracer.invoke([D, B]):
            model.model.layers[0].mlp.output[:] = 0
            model.model.layers[1].output[:, -1] = model.model.layers[1].output[:, -1] * 3
            logits = model.lm_head.output.save()
        with tracer.invoke(C):
            untouched = model.lm_head.output.save()
    lengths = [n_tokens(tok, D), n_tokens(tok, B)]
    return {"logits": Padded(logits, lengths), "untouched": Padded(untouched, [n_tokens(tok, C)])}


@scenario
def activation_patching(model, tok):
    with model.trace() as tracer:
        with tracer.invoke(D):
            clean = model.model.layers[1].output[:, -1].clone()
        with tracer.invoke(E):
            hidden = model.model.layers[1].output  # park first: `clean` exists once D has run
            hidden[:, -1] = clean
            patched = model.lm_head.output[:, -1].save()
    return {"patched": patched}


@scenario
def patching_by_assignment(model, tok):
    with model.trace() as tracer:
        with tracer.invoke(E):
            source = model.model.layers[0].self_attn.output[0]
        with tracer.invoke(D):
            attn = model.model.layers[0].self_attn.output
            model.model.layers[0].self_attn.output = (source, attn[1])
            logits = model.lm_head.output.save()
    return {"logits": logits}


@scenario
def barrier_shares_embeddings(model, tok):
    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(D):
            embeddings = model.model.embed_tokens.output
            barrier()
            d_logits = model.lm_head.output.save()
        with tracer.invoke(E):
            barrier()
            model.model.embed_tokens.output = embeddings
            e_logits = model.lm_head.output.save()
    return {"d": d_logits, "e": e_logits}


@scenario
def session_shares_values(model, tok):
    with model.session():
        with model.trace(D):
            source = model.model.layers[1].output[:, -1].clone()
        with model.trace(E):
            hidden = model.model.layers[1].output
            hidden[:, -1] = source
            patched = model.lm_head.output[:, -1].save()
    return {"patched": patched}


# ---- analysis -----------------------------------------------------------------------------
@scenario
def logit_lens(model, tok):
    with model.trace(A):
        lens = list().save()
        for layer in model.model.layers:
            hidden = layer.output
            lens.append(model.lm_head(model.model.norm(hidden)).softmax(dim=-1)[:, -1])
        final = model.lm_head.output[:, -1].softmax(dim=-1).save()
    return {"lens": lens, "final": final}


@scenario
def gradient_of_loss(model, tok):
    with model.trace(C):
        h0 = model.model.layers[0].output
        h1 = model.model.layers[1].output
        logits = model.lm_head.output
        loss = logits[0, -1].logsumexp(dim=-1) - logits[0, -1, 5]
        with loss.backward():
            g1 = h1.grad.save()
            g0 = h0.grad.save()
        saved_loss = loss.detach().save()
    return {"g1": g1, "g0": g0, "loss": saved_loss}


# ---- generation ---------------------------------------------------------------------------
@scenario
def generate_result(model, tok):
    with model.generate(A, max_new_tokens=5) as tracer:
        ids = tracer.result.save()
    return {"ids": ids}


@scenario
def steering_during_generation(model, tok):
    vector = torch.linspace(-1.0, 1.0, 64)
    with model.generate(B, max_new_tokens=4) as tracer:
        for step in tracer.iter[:4]:
            model.model.layers[1].output[:] += vector
        ids = tracer.result.save()
    return {"ids": ids}


@scenario
def iter_over_generated_tokens(model, tok):
    with model.generate(C, max_new_tokens=4) as tracer:
        hidden = list().save()
        logits = list().save()
        for step in tracer.iter[:4]:
            hidden.append(model.model.layers[2].output)
            logits.append(model.lm_head.output)
    return {"hidden": hidden, "logits": logits}


@scenario
def all_generated_tokens(model, tok):
    with model.generate(D, max_new_tokens=3) as tracer:
        hidden = list().save()
        for step in tracer.all():
            hidden.append(model.model.layers[0].output[:, -1])
    return {"hidden": hidden}


@scenario
def iter_slice(model, tok):
    with model.generate(A, max_new_tokens=4) as tracer:
        picked = list().save()
        for step in tracer.iter[1:3]:
            picked.append(model.model.layers[1].mlp.output)
    return {"picked": picked}


@scenario
def samples_across_steps(model, tok):
    with model.generate(E, max_new_tokens=5) as tracer:
        tokens = list().save()
        for step in tracer.iter[:5]:
            tokens.append(next_token(model))
    with model.generate(E, max_new_tokens=5) as tracer:
        ids = tracer.result.save()
    return {"tokens": [int(t) for t in tokens], "ids": ids}


@scenario
def generate_several_invokes(model, tok):
    with model.generate(max_new_tokens=3) as tracer:
        with tracer.invoke(A):
            a_ids = tracer.result.save()
        with tracer.invoke(B):
            for step in tracer.iter[:3]:
                model.model.layers[0].output[:] *= 0.5
            b_ids = tracer.result.save()
    return {"a": Padded(a_ids, [n_tokens(tok, A) + 3]), "b": Padded(b_ids, [n_tokens(tok, B) + 3])}


@scenario
def generate_repetition_penalty(model, tok):
    with model.generate(C, max_new_tokens=6, repetition_penalty=1.5) as tracer:
        ids = tracer.result.save()
    return {"ids": ids}


@scenario
def generate_default_length(model, tok):
    with model.generate(B) as tracer:  # no max_new_tokens: HF fills up to its default max_length
        ids = tracer.result.save()
    return {"ids": ids}
