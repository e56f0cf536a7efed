"""Plain text generation with the engine alone: `nnrun.LLM(...).generate(prompts, SamplingParams(...))`.

No interventions here: this is the vLLM-style API that the nnsight bridge runs on. Every call
below batches its prompts in one continuous-batching engine.
"""

from __future__ import annotations

from common import parser

import nnrun

PROMPTS = ["The Eiffel Tower is in", "The capital of Japan is", "Wolfgang Mozart was a famous", "Anna reads"]


def main() -> None:
    args = parser(__doc__).parse_args()
    with nnrun.LLM(args.model, device=args.device) as llm:
        print("1. greedy (temperature=0), all prompts in one batch")
        greedy = nnrun.SamplingParams(max_tokens=12, temperature=0)
        for output in llm.generate(PROMPTS, greedy):
            completion = output.outputs[0]
            print(f"   {output.prompt!r} -> {completion.text!r} ({completion.finish_reason})")

        print("\n2. sampling: temperature 1.0, top_p 0.9, a seed per request makes each reproducible")
        prompt = PROMPTS[-1]
        params = [nnrun.SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=seed) for seed in range(4)]
        for seed, output in enumerate(llm.generate([prompt] * len(params), params)):
            print(f"   seed {seed}: {prompt!r} -> {output.outputs[0].text!r}")

        print("\n3. stop strings and the log-probabilities of the top 3 candidates of each new token")
        output = llm.generate(PROMPTS[0], nnrun.SamplingParams(max_tokens=12, temperature=0, stop=["."], logprobs=3))[0]
        completion = output.outputs[0]
        print(f"   {output.prompt!r} -> {completion.text!r} (stopped by {completion.stop_reason!r})")
        for token_id, candidates in zip(completion.token_ids, completion.logprobs):
            ranked = sorted(candidates.items(), key=lambda item: -item[1])
            shown = ", ".join(f"{llm.tokenizer.decode([i])!r} {logprob:.2f}" for i, logprob in ranked)
            print(f"   {llm.tokenizer.decode([token_id])!r}: {shown}")

        print("\n4. streaming: a RequestOutput after every new token, its text so far")
        text = ""
        for chunk in llm.generate_stream(PROMPTS[1], nnrun.SamplingParams(max_tokens=8, temperature=0)):
            completion = chunk.outputs[0]
            print(
                f"   +{completion.text[len(text) :]!r}" + (f" ({completion.finish_reason})" if chunk.finished else "")
            )
            text = completion.text


if __name__ == "__main__":
    main()
