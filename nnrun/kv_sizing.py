"""How much of the GPU the KV pool gets: the engine's share of the card, less what is in use and
less the peak activations of the largest step the scheduler can build (measured by running it).
"""

from __future__ import annotations

GiB = 1 << 30


def kv_budget_bytes(
    total_bytes: int,
    free_bytes: int,
    gpu_memory_utilization: float,
    activation_peak_bytes: int,
    saved_values_bytes: int = 0,
) -> int:
    """Bytes for the KV pool, vLLM's meaning of `gpu_memory_utilization`: the share of the whole card
    this engine may fill. What is already in use (weights, the CUDA context, other processes),
    the largest step's activations and the device budget for saved values (`saved_values_bytes`, which
    running traces' saves may hold) come out of that share; the rest of the card is headroom
    for the attention workspace, the decode CUDA graphs and the allocator's fragmentation.
    """
    in_use = total_bytes - free_bytes
    budget = int(total_bytes * gpu_memory_utilization) - in_use - activation_peak_bytes - saved_values_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} allows {total_bytes * gpu_memory_utilization / GiB:.2f} "
            f"GiB of this {total_bytes / GiB:.2f} GiB GPU, but {in_use / GiB:.2f} GiB are in use already (weights, "
            f"other processes), the largest step needs {activation_peak_bytes / GiB:.2f} GiB of activations and "
            f"saved values may hold {saved_values_bytes / GiB:.2f} GiB: no room is left for the KV cache. Raise "
            "gpu_memory_utilization, lower max_num_batched_tokens, max_num_seqs, max_model_len or "
            "saved_values_device_bytes, or free the GPU."
        )
    return budget


def profile_prompt_lengths(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths of the largest step: `max_num_batched_tokens` tokens over as many requests as
    may run at once (the most logits rows), as few of them as possible as long as `max_model_len`
    (the largest attention spans). Every request has at least one token.
    """
    num_requests = min(max_num_seqs, max_num_batched_tokens)
    lengths = [1] * num_requests
    spare = max_num_batched_tokens - num_requests
    for index in range(num_requests):
        if spare <= 0:
            break
        grow = min(spare, max_model_len - 1)
        lengths[index] += grow
        spare -= grow
    return lengths
