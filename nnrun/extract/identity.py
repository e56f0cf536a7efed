"""Content hashes that identify a model, its tokenizer and an input, so a re-run can tell they changed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

# Up to this many bytes of weights are hashed in full. Past it, each tensor contributes its name,
# shape, dtype and _SAMPLE_WINDOWS evenly spaced windows of _SAMPLE_BYTES: hashing a 14 GB
# checkpoint in full would cost tens of seconds per run, and a sample still catches a different
# checkpoint or a different fine-tune (every window changes). The manifest records which was used.
FULL_HASH_MAX_BYTES = 512 << 20
_SAMPLE_WINDOWS = 16
_SAMPLE_BYTES = 64 << 10


def config_hash(model: torch.nn.Module) -> str:
    """sha256 of the HF config as JSON."""
    config = getattr(model, "config", None)
    text = config.to_json_string() if config is not None else type(model).__name__
    return hashlib.sha256(text.encode()).hexdigest()


def weights_hash(model: torch.nn.Module) -> tuple[str, str]:
    """(sha256 over tensor names, shapes, dtypes and bytes, "full" or "sampled")."""
    state = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    mode = "full" if total <= FULL_HASH_MAX_BYTES else "sampled"
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        raw = _bytes_of(tensor)  # [numel * element_size] uint8
        if mode == "full" or raw.numel() <= _SAMPLE_WINDOWS * _SAMPLE_BYTES:
            digest.update(_to_cpu_bytes(raw))
            continue
        stride = (raw.numel() - _SAMPLE_BYTES) // (_SAMPLE_WINDOWS - 1)
        for window in range(_SAMPLE_WINDOWS):
            digest.update(_to_cpu_bytes(raw[window * stride : window * stride + _SAMPLE_BYTES]))
    return digest.hexdigest(), mode


def checkpoint_hash(folder: str) -> tuple[str, str]:
    """(sha256 over a checkpoint folder's weight files, "checkpoint files"): for a model whose weights this
    process never holds (tensor-parallel ranks each read a shard). Each file gives its name, its size and
    evenly spaced windows of its bytes, or all of them when it is small."""
    digest = hashlib.sha256()
    files = sorted(path for path in Path(folder).iterdir() if path.suffix in (".safetensors", ".bin", ".pt"))
    if not files:
        raise ValueError(f"no weight files (*.safetensors, *.bin) in {folder} to identify the model by")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size};".encode())
        with path.open("rb") as file:
            if size <= _SAMPLE_WINDOWS * _SAMPLE_BYTES:
                digest.update(file.read())
                continue
            stride = (size - _SAMPLE_BYTES) // (_SAMPLE_WINDOWS - 1)
            for window in range(_SAMPLE_WINDOWS):
                file.seek(window * stride)
                digest.update(file.read(_SAMPLE_BYTES))
    return digest.hexdigest(), "checkpoint files"


def tokenizer_hash(tokenizer: Any) -> str | None:
    """sha256 of a fast tokenizer's JSON, or of the vocabulary; None without a tokenizer."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


class InputHasher:
    """A running sha256 over the input records in order; a resume compares the prefix it re-reads."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self.num_records = 0

    def update(self, prompt: Any, error: str | None) -> None:
        self._digest.update(json.dumps([prompt, error]).encode())
        self._digest.update(b"\n")
        self.num_records += 1

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def copy(self) -> "InputHasher":
        """An independent hasher in this one's state (a resume keeps the digest at the record it restarts from)."""
        other = InputHasher()
        other._digest = self._digest.copy()
        other.num_records = self.num_records
        return other


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)  # [numel * element_size]


def _to_cpu_bytes(raw: torch.Tensor) -> memoryview:
    return memoryview(raw.cpu().numpy()).cast("B")
