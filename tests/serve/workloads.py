"""Traces the serve tests run on a served model and on a local one; each returns what it saved.

A workload takes a model (`nnrun.LanguageModel(..., serve=url)` in a client process, or a local
`nnrun.LanguageModel("tiny-facts")` in the test) and returns a dict of tensors to compare.
"""

from __future__ import annotations

import torch

PROMPT = "The Eiffel Tower is in"
OTHER = "The Colosseum is in"
PROMPTS = [PROMPT, OTHER, "The Louvre Museum is in", "The Trevi Fountain is in"]


def is_remote(model) -> bool:
    return hasattr(model, "url")


def logits(model) -> dict:
    with model.trace(PROMPT):
        out = model.lm_head.output.save()
    return {"logits": out}


def layers(model) -> dict:
    with model.trace(OTHER):
        hidden = list().save()
        for i in range(4):
            hidden.append(model.model.layers[i].output)
        norm = model.model.norm.output.save()
    return {f"layer{i}": h for i, h in enumerate(hidden)} | {"norm": norm}


def intervention(model) -> dict:
    with model.trace(PROMPT):
        model.model.layers[1].mlp.output[:] = 0
        out = model.lm_head.output[:, -1].save()
    return {"logits": out}


def invokes(model) -> dict:
    with model.trace() as tracer:
        with tracer.invoke(PROMPT):
            a = model.lm_head.output[:, -1].save()
        with tracer.invoke(OTHER):
            b = model.model.layers[2].output.save()
        with tracer.invoke([PROMPTS[2], PROMPTS[3]]):
            c = model.lm_head.output[:, -1].save()
    return {"a": a, "b": b, "c": c}


def shared_list(model) -> dict:
    with model.trace() as tracer:
        found = list().save()
        for prompt in PROMPTS[:3]:
            with tracer.invoke(prompt):
                found.append(model.model.layers[3].output[:, -1])
    return {f"item{i}": item for i, item in enumerate(found)}


def non_blocking(model) -> dict:
    return _last_logits_each(model, PROMPTS, "p")


def patching(model) -> dict:
    with model.trace() as tracer:
        with tracer.invoke(OTHER):
            source = model.model.layers[1].output[:, 3].clone()
        with tracer.invoke(PROMPT):
            hidden = model.model.layers[1].output
            hidden[:, 3] = source
            patched = model.lm_head.output[0, -1].save()
    return {"patched": patched}


def attention(model) -> dict:
    with model.trace(PROMPT):
        attn = model.model.layers[0].self_attn.output[0].save()
        q = model.model.layers[2].self_attn.q_proj.output.save()
    return {"attn": attn, "q": q}


def burst(model) -> dict:
    return _last_logits_each(model, [PROMPTS[i % 4] + " the" * (i % 3) for i in range(20)], "r")


def _last_logits_each(model, prompts: list[str], key: str) -> dict:
    """One trace per prompt saving its last logits: all sent at once to a server (`blocking=False`), then collected."""
    if is_remote(model):
        tracers = []
        for prompt in prompts:
            with model.trace(prompt, blocking=False) as tracer:
                out = model.lm_head.output[:, -1].save()
            tracers.append(tracer)
        return {f"{key}{i}": tracer.collect()["out"] for i, tracer in enumerate(tracers)}
    results = {}
    for i, prompt in enumerate(prompts):
        with model.trace(prompt):
            out = model.lm_head.output[:, -1].save()
        results[f"{key}{i}"] = out
    return results


def generation(model) -> dict:
    with model.generate(PROMPT, max_new_tokens=4) as tracer:
        steps = list().save()
        for step in tracer.iter[:2]:
            steps.append(model.logits)
        ids = tracer.result.save()
    return {"ids": ids} | {f"step{i}": s for i, s in enumerate(steps)}


def steered_generation(model) -> dict:
    steer = torch.ones(192) * 0.5
    with model.generate(OTHER, max_new_tokens=4) as tracer:
        tokens = list().save()
        for step in tracer.all():  # the loop ends the block: code after it never runs
            model.model.layers[2].output[:, -1] += steer
            tokens.append(model.samples)
    return {f"token{i}": t for i, t in enumerate(tokens)}


WORKLOADS = {
    fn.__name__: fn
    for fn in (
        logits,
        layers,
        intervention,
        invokes,
        shared_list,
        non_blocking,
        patching,
        attention,
        burst,
        generation,
        steered_generation,
    )
}


def run_local(model, names: list[str]) -> dict:
    """The workloads on an in-process model (the reference)."""
    return {name: WORKLOADS[name](model) for name in names}


# ---- hostile traces: each fails only itself ------------------------------------------------
def garbage(model) -> dict:
    from nnrun.serve import wire

    body = model._post("/v1/nnsight/generate", b"\x80\x04garbage that is not a pickle" * 10)
    wire.raise_remote_error(wire.decode_result(body).get("error"))
    return {}


def wrong_path(model) -> dict:
    with model.trace(PROMPT):
        out = model.model.layers[0].no_such_module.output.save()
    return {"out": out}


def raises(model) -> dict:
    with model.trace(PROMPT):
        hidden = model.model.layers[1].output
        if hidden.shape[1] > 0:
            raise KeyError("raised inside the block")
    return {}


def endless_loop(model) -> dict:
    with model.trace(PROMPT):
        hidden = model.model.layers[1].output
        while hidden is not None:
            pass
    return {}


def slow_generation(model) -> dict:
    import time

    with model.generate(PROMPT, max_new_tokens=60, min_new_tokens=60) as tracer:
        for step in tracer.all():  # 0.1 s a step, parking every step: slow, never over the block limit
            time.sleep(0.1)
            model.logits
    return {}


def writes_nan(model) -> dict:
    with model.trace(PROMPT):
        model.model.layers[1].output[:] = float("nan")
        out = model.lm_head.output.save()
    return {"out": out}


HOSTILE = {fn.__name__: fn for fn in (garbage, wrong_path, raises, endless_loop, writes_nan)}
WORKLOADS.update(HOSTILE, slow_generation=slow_generation)
