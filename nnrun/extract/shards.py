"""Shard files: gather one shard's rows, write them as safetensors under a temp name, then rename.

The writer is our own rather than `safetensors.torch.save_file`, whose header order of metadata
keys varies from process to process; here the header is sorted JSON and the data follows in
sorted key order, so the same tensors always give the same bytes (resume is byte-identical).
The format is plain safetensors: `safe_open` reads the files, memory-mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from nnrun.extract.manifest import ShardInfo

TOKEN_IDS_KEY = "token_ids"  # [num_tokens] int32: every prompt token, prompts back to back
PROMPT_INDEX_KEY = "prompt_index"  # [num_prompts] int64: each prompt's index in the input
PROMPT_NUM_TOKENS_KEY = "prompt_num_tokens"  # [num_prompts] int32

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class ShardWriteError(OSError):
    """Writing a shard failed (disk full, permissions); the complete shards before it are intact."""


def activation_key(module: str) -> str:
    """Name of a module's activations inside a shard: `[num_rows, *shape]`."""
    return f"activations.{module}"


def shard_file_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def dtype_code(dtype: torch.dtype | None) -> str | None:
    """safetensors' name of a dtype ("F32"), or None for one it cannot store."""
    return _DTYPE_CODES.get(dtype)


class ShardBuffer:
    """The prompts of one shard, gathered forward batch by forward batch."""

    def __init__(self, modules: list[str]) -> None:
        self.modules = modules
        self.prompt_index: list[int] = []
        self.prompt_num_tokens: list[int] = []
        self.num_rows_per_prompt: list[int] = []
        self._token_ids: list[torch.Tensor] = []  # each [num_tokens of a batch] int32
        self._rows: dict[str, list[torch.Tensor]] = {m: [] for m in modules}  # each [rows of a batch, *shape]

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_index)

    @property
    def num_tokens(self) -> int:
        return sum(self.prompt_num_tokens)

    def add(
        self,
        indices: list[int],
        token_id_lists: list[list[int]],
        rows: dict[str, torch.Tensor],
        rows_per_prompt: list[int],
    ) -> None:
        """Append one batch: its prompts in order and each module's rows for them, back to back."""
        if sorted(rows) != sorted(self.modules):
            raise ValueError(f"rows must hold exactly the modules {self.modules}, got {sorted(rows)}")
        if len(indices) != len(token_id_lists) or len(indices) != len(rows_per_prompt):
            raise ValueError("indices, token_id_lists and rows_per_prompt must have equal lengths")
        for module, tensor in rows.items():
            if tensor.shape[0] != sum(rows_per_prompt):
                raise ValueError(f"{module}: {tensor.shape[0]} rows for {sum(rows_per_prompt)} expected")
            self._rows[module].append(tensor)
        self.prompt_index.extend(indices)
        self.prompt_num_tokens.extend(len(ids) for ids in token_id_lists)
        self.num_rows_per_prompt.extend(rows_per_prompt)
        flat = [t for ids in token_id_lists for t in ids]
        self._token_ids.append(torch.tensor(flat, dtype=torch.int32))  # [num_tokens of the batch]

    def packed(self) -> "ShardBuffer":
        """This buffer with each part joined into one host tensor: what an engine hands to another process."""
        packed = ShardBuffer(self.modules)
        packed.prompt_index = list(self.prompt_index)
        packed.prompt_num_tokens = list(self.prompt_num_tokens)
        packed.num_rows_per_prompt = list(self.num_rows_per_prompt)
        packed._token_ids = [torch.cat(self._token_ids)] if self._token_ids else []
        packed._rows = {m: [torch.cat(parts).cpu()] if parts else [] for m, parts in self._rows.items()}
        return packed

    def row_shapes(self) -> dict[str, list[int]]:
        """Each module's per-row shape, e.g. [H]."""
        return {module: list(parts[0].shape[1:]) for module, parts in self._rows.items() if parts}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything the shard file holds, by key."""
        tensors = {
            TOKEN_IDS_KEY: torch.cat(self._token_ids) if self._token_ids else torch.zeros(0, dtype=torch.int32),
            PROMPT_INDEX_KEY: torch.tensor(self.prompt_index, dtype=torch.int64),
            PROMPT_NUM_TOKENS_KEY: torch.tensor(self.prompt_num_tokens, dtype=torch.int32),
        }
        for module, parts in self._rows.items():
            tensors[activation_key(module)] = torch.cat(parts)
        return tensors


def write_shard(directory: Path, shard: int, buffer: ShardBuffer) -> ShardInfo:
    """Write shard `shard` under a temp name and rename it when complete; raise ShardWriteError on failure."""
    path = Path(directory) / shard_file_name(shard)
    tmp = path.with_name(path.name + ".tmp")
    try:
        num_bytes, sha256 = write_safetensors(tmp, buffer.tensors())
        os.replace(tmp, path)  # made durable by the directory fsync of the manifest update that follows
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise ShardWriteError(
            error.errno,
            f"could not write {path.name} ({error.strerror or error}); the {shard} shards "
            "before it are complete: fix the cause and re-run the same command to resume",
        ) from error
    num_rows = sum(buffer.num_rows_per_prompt)
    return ShardInfo(path.name, buffer.num_prompts, buffer.num_tokens, num_rows, num_bytes, sha256)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write a safetensors file deterministically and fsync it; return (size, sha256)."""
    header: dict[str, dict] = {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        tensor = tensors[name]
        if tensor.dtype not in _DTYPE_CODES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data to 8 bytes
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in _chunks(header_bytes, names, tensors):
            f.write(chunk)
            digest.update(chunk)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(header_bytes) + offset, digest.hexdigest()


def _chunks(header_bytes: bytes, names: list[str], tensors: dict[str, torch.Tensor]):
    yield struct.pack("<Q", len(header_bytes))
    yield header_bytes
    for name in names:
        tensor = tensors[name].detach().cpu().contiguous()
        if tensor.numel():
            yield memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
