"""Shared workload helpers for the benchmarks: a dummy-weight model of real shape and prompts."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import LlamaConfig


def llama_30m_config() -> LlamaConfig:
    """About 31M parameters: hidden 512, 8 layers, GQA 8/4 heads, 16k vocabulary, tied embeddings."""
    return LlamaConfig(vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                       tie_word_embeddings=True)


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
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


@contextmanager
def timed(results: dict, name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    results[name] = time.perf_counter() - start
