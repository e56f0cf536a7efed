"""Quickstart: load a model, trace a prompt, save every layer's output, edit an activation, generate with an edit.

The code inside each `with` block is nnsight's: it runs on nnrun's engine, beside other
requests, against the unmodified HF module tree.
"""

from __future__ import annotations

from common import find_layout, parser, top_tokens

import nnrun

PROMPT = "The Louvre Museum is in"


def main() -> None:
    args = parser(__doc__).parse_args()
    model = nnrun.LanguageModel(args.model, device=args.device)
    tokenizer = model.tokenizer
    parts = find_layout(model)
    layers = parts.layers
    upper = layers[len(layers) // 2 :]
    print(f"loaded {args.model}: {type(model.engine.model).__name__}, {len(layers)} blocks at {parts.layers_path}\n")

    print(f"1. trace {PROMPT!r}: save every block's output and the logits")
    with model.trace(PROMPT):
        hidden = list().save()  # a list made and saved in the trace comes back filled
        for layer in layers:
            hidden.append(layer.output)
        logits = parts.unembed.output.save()
    for i, value in enumerate(hidden):
        print(
            f"   {parts.layers_path}.{i} output: shape {tuple(value.shape)}, last-token norm {value[0, -1].norm():.1f}"
        )
    print(f"   next token: {top_tokens(tokenizer, logits[0, -1])}\n")

    print(f"2. edit: zero the last token's attention output in blocks {len(layers) // 2}..{len(layers) - 1}")
    with model.trace(PROMPT):
        for layer in upper:
            getattr(layer, parts.attn_name).output[0][:, -1] = 0
        edited = parts.unembed.output.save()
    print(f"   next token: {top_tokens(tokenizer, edited[0, -1])}\n")

    print("3. generate, plainly and with the same edit on the prompt's forward pass")
    plain_ids = model.generate(PROMPT, max_new_tokens=8)  # [1, prompt + new tokens]
    with model.generate(PROMPT, max_new_tokens=8) as tracer:
        for layer in upper:  # outside a tracer.iter loop, an edit applies to the first forward only
            getattr(layer, parts.attn_name).output[0][:, -1] = 0
        edited_ids = tracer.result.save()
    print(f"   plain:  {tokenizer.decode(plain_ids[0], skip_special_tokens=True)!r}")
    print(f"   edited: {tokenizer.decode(edited_ids[0], skip_special_tokens=True)!r}")
    model.shutdown()


if __name__ == "__main__":
    main()
