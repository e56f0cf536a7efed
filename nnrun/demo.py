"""`make demo`: a first tour of nnrun on the bundled tiny-facts model (offline, CPU, seconds)."""

from __future__ import annotations

import torch

import nnrun

# tiny-facts is trained so that a subject's identity sits at its last token after the early
# layers (nnrun/assets/interchange.py); both subjects end in " Museum" so positions line up.
CLEAN, CLEAN_SUBJECT = "The Louvre Museum is in", "The Louvre Museum"
CORRUPT = "The Capitoline Museum is in"


def top_tokens(model: nnrun.LanguageModel, logits: torch.Tensor, k: int = 3) -> str:
    probs = logits.float().softmax(-1)
    values, ids = probs.topk(k)
    return ", ".join(f"{model.tokenizer.decode(i)!r} {p:.2f}" for p, i in zip(values.tolist(), ids.tolist()))


def main() -> None:
    print("nnrun demo: nnsight code on a continuous-batching engine, HF's modules and values.\n")
    model = nnrun.LanguageModel("tiny-facts")
    layers = model.model.layers
    print(f"loaded the bundled 'tiny-facts' model ({type(model._module).__name__}, {len(layers)} layers)\n")

    print(f"1. Trace and save: run {CLEAN!r} and keep a hidden state and the logits")
    with model.trace(CLEAN):
        hidden = layers[len(layers) // 2].output.save()
        logits = model.lm_head.output.save()
    print(f"   model.model.layers[{len(layers) // 2}].output: shape {tuple(hidden.shape)} (batch, tokens, hidden)")
    print(f"   next-token prediction: {top_tokens(model, logits[0, -1])}\n")

    print("2. Edit: silence the attention of the last token in the upper layers, which fetch the answer")
    with model.trace(CLEAN):
        for layer in layers[len(layers) // 2 :]:
            layer.self_attn.output[0][:, -1] = 0
        edited = model.lm_head.output.save()
    print(f"   edited prediction: {top_tokens(model, edited[0, -1])}\n")

    print(f"3. Activation patching: copy one residual state of {CORRUPT!r} into {CLEAN!r}")
    subject_last = len(model.tokenizer(CLEAN_SUBJECT)["input_ids"]) - 1
    final = len(model.tokenizer(CLEAN)["input_ids"]) - 1
    for position, label in ((subject_last, "subject's last token"), (final, "last token")):
        for layer_idx in range(len(layers)):
            with model.trace() as tracer:
                with tracer.invoke(CORRUPT):
                    source = layers[layer_idx].output[:, position]
                with tracer.invoke(CLEAN):
                    hidden = layers[layer_idx].output  # wait for this layer first: by then `source` exists
                    hidden[:, position] = source
                    patched = model.lm_head.output[0, -1].save()
            print(f"   layer {layer_idx}, {label:>20}: {top_tokens(model, patched, k=2)}")
    print("   (the subject's identity moves from its own position to the last one as layers go up)\n")

    print("4. The engine alone (vLLM's API): greedy completions, batched in one engine")
    llm = model.engine
    prompts = [CLEAN, CORRUPT, "The Eiffel Tower is in", "The capital of Japan is"]
    for output in llm.generate(prompts, nnrun.SamplingParams(max_tokens=4, temperature=0)):
        print(f"   {output.prompt!r} -> {output.outputs[0].text!r}")
    model.shutdown()


if __name__ == "__main__":
    main()
