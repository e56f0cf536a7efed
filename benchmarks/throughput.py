"""Engine throughput against plain HF transformers, measured in one run on the same workload.

Prefill: N prompts (lengths uniform in 16..512) through a ~30M-parameter dummy-weight Llama,
nnrun (packed, continuous batching) vs HF padded batches of 16 vs HF one prompt at a time.
Generation: greedy 128 new tokens for 64 prompts, nnrun vs HF `generate` on padded batches of 16.
Prints tokens/s and the ratios (these machines are noisy: only the ratios mean much).
"""

from __future__ import annotations

import argparse

import torch
from common import left_padded, llama_30m_config, random_prompts, timed
from transformers import AutoModelForCausalLM

import nnrun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--num-gen-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = llama_30m_config()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    llm = nnrun.LLM(config, load_format="dummy", max_num_batched_tokens=4096)
    hf.load_state_dict(llm.model.state_dict())  # the same weights for both
    params = sum(p.numel() for p in hf.parameters())
    prompts = random_prompts(args.num_prompts, 16, 512, config.vocab_size)
    num_tokens = sum(map(len, prompts))
    print(
        f"model: dummy Llama, {params / 1e6:.1f}M params; {len(prompts)} prompts, {num_tokens} tokens; "
        f"torch threads {torch.get_num_threads()}"
    )

    times: dict[str, float] = {}
    llm.generate(prompts[:4], nnrun.SamplingParams(max_tokens=1))  # warm-up
    with timed(times, "nnrun"):
        llm.generate(prompts, nnrun.SamplingParams(max_tokens=1, temperature=0))
    with torch.no_grad(), timed(times, "hf_padded"):
        for start in range(0, len(prompts), args.hf_batch_size):
            ids, mask = left_padded(prompts[start : start + args.hf_batch_size])
            hf(ids, attention_mask=mask, logits_to_keep=1)
    with torch.no_grad(), timed(times, "hf_single"):
        for prompt in prompts:
            hf(torch.tensor([prompt]), logits_to_keep=1)
    rate = {name: num_tokens / seconds for name, seconds in times.items()}
    print(
        f"prefill tokens/s: nnrun {rate['nnrun']:.0f} | HF padded x{args.hf_batch_size} {rate['hf_padded']:.0f} "
        f"| HF one at a time {rate['hf_single']:.0f}"
    )
    print(
        f"prefill ratio: nnrun/HF-padded {rate['nnrun'] / rate['hf_padded']:.2f}x, "
        f"nnrun/HF-single {rate['nnrun'] / rate['hf_single']:.2f}x"
    )

    gen_prompts = prompts[: args.num_gen_prompts]
    new_tokens = len(gen_prompts) * args.max_new_tokens
    gen: dict[str, float] = {}
    greedy = nnrun.SamplingParams(max_tokens=args.max_new_tokens, temperature=0, ignore_eos=True)
    with timed(gen, "nnrun"):
        llm.generate(gen_prompts, greedy)
    with torch.no_grad(), timed(gen, "hf_generate"):
        for start in range(0, len(gen_prompts), args.hf_batch_size):
            ids, mask = left_padded(gen_prompts[start : start + args.hf_batch_size])
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args.max_new_tokens,
                min_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    gen_rate = {name: new_tokens / seconds for name, seconds in gen.items()}
    print(
        f"generation ({len(gen_prompts)} prompts x {args.max_new_tokens} new tokens) tokens/s: "
        f"nnrun {gen_rate['nnrun']:.0f} | HF generate padded x{args.hf_batch_size} {gen_rate['hf_generate']:.0f}"
    )
    print(f"generation ratio: nnrun/HF-generate {gen_rate['nnrun'] / gen_rate['hf_generate']:.2f}x")
    llm.shutdown()


if __name__ == "__main__":
    main()
