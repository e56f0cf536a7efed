"""How close a packed value must be to its solo (or plain HF) twin.

A packed forward sums the same products in another order than a solo one (other matmul shapes,
other SDPA calls), so fp32 values move by a few ulps of the largest values they were summed from:
about 1e-6 of the tensor's magnitude, and 1e-5 on a hidden state near 13 has been seen. A tolerance
per element (`rtol`) is wrong for that: an element near zero in a tensor of magnitude 10 carries the
same absolute noise as its neighbours. So the bound is one absolute figure scaled by the tensor's
largest magnitude (at least 1), far below what any real bug moves (a wrong position or a leaked
token shifts logits by 1e-2 and more).
"""

from __future__ import annotations

import torch

PACKED_REL = 1e-5  # a hundred fp32 ulps of the tensor's largest value


def packed_atol(expected: torch.Tensor, rel: float = PACKED_REL) -> float:
    """The absolute bound for comparing against `expected`: `rel` times its largest magnitude, at least `rel`."""
    expected = expected.detach().float()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return rel * max(1.0, scale)


def assert_close_packed(actual: torch.Tensor, expected: torch.Tensor, rel: float = PACKED_REL, msg: str = "") -> None:
    """Assert `actual` equals `expected` up to float summation order, relative to the values' size."""
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(
        actual.detach().float(),
        expected.detach().float(),
        atol=packed_atol(expected, rel),
        rtol=0,
        msg=(lambda m: f"{msg}: {m}") if msg else None,
    )
