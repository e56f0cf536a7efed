"""Shared workload helpers for the benchmarks: dummy-weight models of real shapes, prompts, roofline arithmetic."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from transformers import LlamaConfig


def llama_30m_config() -> LlamaConfig:
    """About 31M parameters: hidden 512, 8 layers, GQA 8/4 heads, 16k vocabulary, tied embeddings."""
    return LlamaConfig(
        vocab_size=16384,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def random_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def left_padded(batch: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style left padding: ([B, T_max] ids, [B, T_max] attention mask)."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@contextmanager
def timed(results: dict, name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    results[name] = time.perf_counter() - start


# Dense bf16/fp16 FLOP/s and HBM bytes/s, matched against torch.cuda.get_device_name; the H200 first.
DEVICE_PEAKS = (
    ("H200", 989e12, 4.8e12),
    ("H100 80GB HBM3", 989e12, 3.35e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100 PCIe", 756e12, 2.0e12),
)


def shape_config(shape: str) -> LlamaConfig:
    """LlamaConfig of a named shape: Llama-3.2-1B, Llama-3-8B, or a tiny one for CPU tests (no rope scaling)."""
    llama3 = {
        "vocab_size": 128256,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
    }
    shapes = {
        "tiny": {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
        },
        "1b": {
            **llama3,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "head_dim": 64,
            "tie_word_embeddings": True,
        },
        "8b": {
            **llama3,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "head_dim": 128,
            "tie_word_embeddings": False,
        },
    }
    return LlamaConfig(**shapes[shape])


def device_peaks(device_name: str) -> tuple[float, float] | None:
    """(dense bf16 FLOP/s, HBM bytes/s) of a known GPU, or None (unknown device, CPU)."""
    return next(((flops, bandwidth) for key, flops, bandwidth in DEVICE_PEAKS if key in device_name), None)


def non_embedding_params(config: LlamaConfig) -> int:
    """Weights every token multiplies through: the decoder layers and final norm (Llama has no biases)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = 2 * hidden * q_dim + 2 * hidden * kv_dim + 3 * hidden * config.intermediate_size + 2 * hidden
    return config.num_hidden_layers * per_layer + hidden


def prefill_flops(config: LlamaConfig, prompt_lens: list[int]) -> float:
    """Forward FLOPs of a prefill keeping one logits row per prompt.

    2 per weight per token; causal attention's QK^T and AV over L^2/2 pairs each; the LM head on
    the kept rows only.
    """
    attn_dim = config.num_attention_heads * config.head_dim
    attention = 2 * 2 * config.num_hidden_layers * attn_dim * sum(n * n / 2 for n in prompt_lens)
    lm_head = 2 * config.vocab_size * config.hidden_size * len(prompt_lens)
    return 2 * non_embedding_params(config) * sum(prompt_lens) + attention + lm_head


def decode_step_bytes(config: LlamaConfig, itemsize: int, batch: int, context_len: float) -> float:
    """Bytes one decode step reads at least: every weight once and each sequence's K and V over `context_len`.

    The LM head is read whole; an untied input embedding is not (only B rows are gathered).
    """
    weights = non_embedding_params(config) + config.vocab_size * config.hidden_size
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * context_len * batch
    return (weights + kv) * itemsize


def interleaved_times(baseline, ours, reps: int) -> tuple[float, float]:
    """Median seconds of `baseline()` and `ours()` over `reps` rounds, alternating which runs first."""
    base_times, our_times = interleaved_runs(baseline, ours, reps)
    return sorted(base_times)[reps // 2], sorted(our_times)[reps // 2]


def interleaved_runs(baseline, ours, reps: int) -> tuple[list[float], list[float]]:
    """Seconds of each of `reps` rounds of `baseline()` and `ours()`, alternating which runs first.

    Interleaving in one process is what makes a ratio meaningful on a shared, noisy CPU: both
    sides see the same background load, where separate runs would not.
    """
    base_times, our_times = [], []
    for rep in range(reps):
        pair = [(baseline, base_times), (ours, our_times)]
        for fn, times in pair if rep % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return base_times, our_times


class StepTimer:
    """Wraps an engine's step phases (instance attributes only) and sums their seconds."""

    def __init__(self, llm: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # time.thread_time: the engine thread's CPU time, which other processes' load leaves alone
        self.seconds: dict[str, float] = defaultdict(float)
        self.num_steps = 0
        core, runner = llm.core, llm.runner
        self.wrap(core.scheduler, "schedule", "schedule")
        self.wrap(runner, "prepare_forward_batch_decode", "prepare")
        self.wrap(runner, "prepare_forward_batch_extend", "prepare")
        if hasattr(runner, "advance_decode_batch"):  # the engine's decode chain (absent before issue 36)
            self.wrap(runner, "advance_decode_batch", "prepare")
        self.wrap(runner.attn_backend, "init_forward_metadata", "plan")
        self.wrap(runner.attn_backend, "forward", "attention")
        self.wrap(runner, "run_model", "model")
        self.wrap(runner, "sample", "sample")
        self.wrap(core, "step", "step")

    def wrap(self, owner: object, method: str, section: str) -> None:
        inner: Callable = getattr(owner, method)

        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[section] += self.clock() - start
                self.num_steps += section == "step"

        setattr(owner, method, timed)

    @contextmanager
    def measuring(self) -> Iterator[None]:
        self.seconds.clear()
        self.num_steps = 0
        yield

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step by section; `model` excludes the plan and `bookkeeping` is what is left."""
        s, steps = self.seconds, max(1, self.num_steps)
        model = s["model"] - s["plan"]
        rest = s["step"] - s["schedule"] - s["prepare"] - s["model"] - s["sample"]
        parts = {
            "schedule": s["schedule"],
            "prepare": s["prepare"],
            "plan": s["plan"],
            "model": model,
            "attention": s["attention"],
            "sample": s["sample"],
            "bookkeeping": rest,
            "step": s["step"],
        }
        return {name: 1e3 * value / steps for name, value in parts.items()}
