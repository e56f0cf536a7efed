"""The per-request shortcut in checking sampling settings gives exactly the slow path's results.

The oracle: the field checks as they were written before their shortcut (kept here verbatim).
"""

from __future__ import annotations

import enum
import fractions
import math
import numbers

import numpy as np
import pytest

from nnrun import sampling_params


def _reference_int_field(name, value, *, minimum, maximum=None, optional=False):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if optional else "an int"
        raise ValueError(f"SamplingParams.{name} must be {kind}, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"SamplingParams.{name} must be {bounds}, got {value}")
    return value


def _reference_float_field(name, value, low, high, *, is_low_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"SamplingParams.{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    is_outside = value < low or value > high or (is_low_open and value == low)
    if not math.isfinite(value) or is_outside:
        interval = f"{'(' if is_low_open else '['}{low:g}, {high:g}{')' if math.isinf(high) else ']'}"
        raise ValueError(f"SamplingParams.{name} must be a finite number in {interval}, got {value!r}")
    return value


class _Level(enum.IntEnum):
    HIGH = 3


class _Ratio(float):
    pass


VALUES = [
    0,
    1,
    -1,
    2,
    3,
    10**30,
    -(2**63),
    2**64 - 1,
    2**64,
    10**400,
    True,
    False,
    None,
    0.0,
    -0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    -2.0,
    1e-6,
    1e-5,
    float("nan"),
    float("inf"),
    -float("inf"),
    np.int64(5),
    np.int32(-1),
    np.float32(0.5),
    np.float64(2.5),
    np.bool_(True),
    _Level.HIGH,
    _Ratio(0.25),
    fractions.Fraction(1, 3),
    "1",
    "0.5",
    [1],
    object,
]


def _outcome(check, *args, **kwargs):
    """What a check does: (its value, the value's type) or (the error's type, its message)."""
    try:
        value = check(*args, **kwargs)
    except Exception as error:  # OverflowError too (float(10**400)): the shortcut must raise the same
        return type(error), str(error)
    return value if value == value else "nan", type(value)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_field_checks_accept_and_refuse_exactly_as_before(value):
    int_fields = [
        dict(minimum=1, optional=True),
        dict(minimum=0),
        dict(minimum=-1),
        dict(minimum=-(2**63), maximum=2**64 - 1, optional=True),
    ]
    for bounds in int_fields:
        assert _outcome(sampling_params._int_field, "f", value, **bounds) == _outcome(
            _reference_int_field, "f", value, **bounds
        ), bounds
    float_fields = [
        (0.0, math.inf, False),
        (0.0, 1.0, True),
        (0.0, 1.0, False),
        (0.0, math.inf, True),
        (-2.0, 2.0, False),
    ]
    for low, high, is_low_open in float_fields:
        assert _outcome(sampling_params._float_field, "f", value, low, high, is_low_open=is_low_open) == _outcome(
            _reference_float_field, "f", value, low, high, is_low_open=is_low_open
        )
