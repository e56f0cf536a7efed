"""Traces of several shapes, for running many at once from threads against running each alone."""

from __future__ import annotations

import torch

WORDS = ["the", "eiffel", "tower", "is", "in", "city", "of", "paris", "rome", "big", "ben", "cat", "sat", "mat"]


def prompt(seed: int, length: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=generator).tolist())


def read(model, text):
    with model.trace(text):
        h = model.model.layers[1].output.save()
        logits = model.lm_head.output.save()
    return {"h": h, "logits": logits}


def zero_mlp(model, text):
    with model.trace(text):
        model.model.layers[0].mlp.output[:] = 0
        logits = model.lm_head.output.save()
    return {"logits": logits}


def patch(model, text):
    with model.trace() as tracer:
        with tracer.invoke(text):
            clean = model.model.layers[1].output[:, -1].clone()
        with tracer.invoke("the cat sat on the mat"):
            hidden = model.model.layers[1].output
            hidden[:, -1] = clean
            logits = model.lm_head.output.save()
    return {"logits": logits}


def steer(model, text):
    with model.generate(text, max_new_tokens=4) as tracer:
        for step in tracer.iter[:4]:
            model.model.layers[1].output[:] += 0.5
        ids = tracer.result.save()
    return {"ids": ids}


def per_step(model, text):
    with model.generate(text, max_new_tokens=3) as tracer:
        hidden = list().save()
        for step in tracer.iter[:3]:
            hidden.append(model.model.layers[2].output)
        ids = tracer.result.save()
    return {"hidden": hidden, "ids": ids}


def lens(model, text):
    with model.trace(text):
        probs = list().save()
        for layer in model.model.layers:
            probs.append(model.lm_head(model.model.norm(layer.output)).softmax(-1)[:, -1])
    return {"probs": probs}


def skip(model, text):
    with model.trace(text):
        model.model.layers[1].skip(model.model.layers[1].input)
        logits = model.lm_head.output.save()
    return {"logits": logits}


def grad(model, text):
    with model.trace(text):
        hidden = model.model.layers[0].output
        loss = model.lm_head.output[0, -1].logsumexp(-1)
        with loss.backward():
            g = hidden.grad.save()
    return {"g": g}


def list_invoke(model, text):
    with model.trace() as tracer:
        with tracer.invoke([text, "big ben is in"]):
            model.model.layers[2].mlp.output[:, -1] = 0
            logits = model.lm_head.output.save()
    return {"logits": logits}


KINDS = [read, zero_mlp, patch, steer, per_step, lens, skip, grad, list_invoke]
