"""A trace's answer as a plain pickle with tensors as raw bytes: what nnrun's own client asks for.

`torch.save` writes a zip archive (a header, a record per storage) and `torch.load` reads it
back: about 0.15 ms and 0.2-0.5 ms for a few small saves, a quarter of what a served trace costs
its client. A pickle whose tensors travel as (bytes, dtype, shape) takes about 20 us both ways.

Only what the raw form carries exactly goes that way: a plain dense CPU tensor that does not
require grad. A payload holding anything else (a Parameter, a tensor with grad, a sparse one)
or two tensors sharing a storage (a saved tensor and a view of it, which `torch.save` keeps
shared) is not encoded here (`dumps` returns None) and goes through `torch.save` instead.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

PROTOCOL = 5
MAGIC = b"\x80\x05"  # how a protocol-5 pickle starts; `torch.save`'s zip starts with b"PK"


class _NotRaw(Exception):
    """The payload holds a tensor the raw form would not carry exactly."""


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


class _RawTensorPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.storages: set[int] = set()

    def reducer_override(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return NotImplemented
        if type(value) is not torch.Tensor or value.layout != torch.strided or not value.is_cpu or value.requires_grad:
            raise _NotRaw
        storage = value.untyped_storage().data_ptr()
        if storage in self.storages and value.numel():
            raise _NotRaw  # shared with another saved tensor: torch.save keeps them shared
        self.storages.add(storage)
        return _tensor_from_bytes, (_raw_bytes(value), value.dtype, tuple(value.shape))


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order, as bytes.

    Through numpy where it can (a view, whatever the strides): on a server whose worker threads
    share the GIL with the engine thread, every torch op releases and retakes the GIL, and under
    contention each of those is a wait behind the engine's forward.
    """
    try:
        return tensor.numpy().tobytes()  # numpy() refuses a tensor with its conjugate or negative bit set
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, float8), or one of those bits
        if tensor.is_conj() or tensor.is_neg():
            raise _NotRaw from None
        return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def dumps(payload: Any) -> bytes | None:
    """`payload` pickled with its tensors as raw bytes, or None if one of them needs `torch.save`."""
    buffer = io.BytesIO()
    try:
        _RawTensorPickler(buffer).dump(payload)
    except _NotRaw:
        return None
    return buffer.getvalue()


def loads(content: bytes) -> Any:
    return pickle.loads(content)
