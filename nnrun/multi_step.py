"""Multi-step decode: several decode steps per scheduling decision when nothing needs the host between them.

A decode window of k steps runs k forwards of the same requests back to back: each step's sampled
tokens stay on the device and are the next step's input ids, the next step's layout is advanced
from the last one (`next_decode_forward_batch`), and the tokens become Python ints once, after the
last step. The engine then appends them step by step through the usual stop checks, so outputs
are today's exactly: a request that stops inside the window keeps the tokens up to its stop, and
what it sampled after (its rows ran on, unseen) is dropped with its KV. Every step's batch is what
scheduling each step would make it, but for those stopped rows riding along to the window's end;
while requests wait for room, a window runs only if no request can stop before its last step.

k is chosen per batch so that nothing the host decides can change inside the window: no request
may reach max_tokens, the context length or min_tokens before its last step (k is the minimum of
what each has left), and a request that needs the host after every token (stop strings, streaming,
penalties, which read the tokens so far; a runner that watches its steps, such as a trace's) takes
one step at a time. EOS and stop tokens are the only stops a window can pass; the tokens after them
are dropped. Seeded requests draw from their own generators exactly as step by step for every token
kept (draws after a stop are of a finished request's generator, which nothing reads again).
Unseeded sampled rows draw from torch's default RNG, as ever; a stopped row riding along draws from
it too, so after a stop inside a window their tokens are other draws of the same distribution.
"""

from __future__ import annotations

from typing import Protocol

import torch

from nnrun.config import EngineConfig
from nnrun.request import Request

# Default decode steps per scheduling decision. On CUDA a window keeps the GPU fed while the host
# would otherwise schedule, sync and pythonize every step (vLLM's multi-step default is 8; 4 keeps
# aborts and new arrivals waiting at most 3 steps). On CPU the forward blocks the host anyway, and
# what a window saves (scheduling, ~0.05 ms a step) is within noise: benchmarks/step_overhead.py's
# multi-step table gave the engine thread 1.16/1.17/1.16 ms a decode step at batch 1 and 3.82/3.83/
# 3.78 ms at batch 256 for k = 1, 4, 8 on the tiny Llama. So one step per decision there, where a
# window would only make aborts and arrivals wait; `num_scheduler_steps` turns windows on anywhere.
# On CUDA 4, measured on an H200 (Llama-3-8B shape, bf16, FlashInfer, decode graphs; docs/gpu.md): decode
# 130 -> 135 tok/s at batch 1, 6216 -> 6686 at 64, 16108 -> 16739 at 256; the GPU's idle share of a step
# 43/27/35% -> 21/16/12%.
DEFAULT_CUDA_SCHEDULER_STEPS = 4
DEFAULT_CPU_SCHEDULER_STEPS = 1


class WindowRunner(Protocol):
    def allows_multi_step(self, reqs: list[Request]) -> bool: ...


def max_scheduler_steps(config: EngineConfig) -> int:
    """`SchedulerConfig.num_scheduler_steps`, or the device's default when unset."""
    steps = config.scheduler.num_scheduler_steps
    if steps is not None:
        return steps
    return DEFAULT_CUDA_SCHEDULER_STEPS if str(config.device.device).startswith("cuda") else DEFAULT_CPU_SCHEDULER_STEPS


def decode_window_size(
    reqs: list[Request], max_steps: int, max_model_len: int, runner: WindowRunner, has_waiting: bool = False
) -> int:
    """How many decode steps `reqs` may run before the host must look at their tokens (1: one, as always).

    The limit of each request is what it has left before max_tokens, the context length, or (while
    short of it) min_tokens, whose stop-token mask must stay the same for the whole window. With
    requests waiting (`has_waiting`), a request that could stop on a token inside the window would
    free room a waiting one might take at the next step: then the batch steps one at a time, so
    admissions, and so every step's batch, are what scheduling each step would make them.
    """
    num_steps = max_steps
    for req in reqs:
        if num_steps <= 1:
            return 1
        params = req.sampling_params
        if req.is_streamed or params.stop_strings or params.has_penalties:
            return 1
        num_output = len(req.output_token_ids)
        if params.max_tokens is not None:
            num_steps = min(num_steps, params.max_tokens - num_output)
        if num_output < params.min_tokens:  # EOS and stop tokens are masked until min_tokens
            num_steps = min(num_steps, params.min_tokens - num_output)
        elif has_waiting and (params.stop_token_ids or not params.ignore_eos):
            return 1
        num_steps = min(num_steps, max_model_len - len(req.prompt_token_ids) - num_output)
    if num_steps <= 1 or not runner.allows_multi_step(reqs):
        return 1
    return num_steps


def to_host_lists(step_token_ids: list[torch.Tensor]) -> list[list[int]]:
    """The window's sampled tokens (`[B]` per step, on the device) as Python ints, per step.

    On CUDA the copy to the host is queued after the last step and waited for on an event recorded
    behind it: the host syncs once per window, not once per step.
    """
    tokens = torch.stack(step_token_ids)  # [k, B] int64
    if tokens.device.type != "cuda":
        return tokens.tolist()
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)  # [k, B]
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    ready.synchronize()
    return host.tolist()
