"""Byte sizes: parsing ``"2GiB"``, printing ``1.50 KiB``, and the bytes of a tensor or variable.

Plain Python (NumPy only for unusual dtypes): no TensorFlow or Keras import, so the launcher and the planners use it
without loading TensorFlow.

Example:
    >>> parse_size("1.5 KiB"), format_bytes(1536)
    (1536, '1.50 KiB')
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

__all__ = ["dtype_size", "format_bytes", "nbytes", "parse_size"]


_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_ACCEPTED_UNITS = "B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024)"
_SIZE_RE = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")
_IEC = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def parse_size(value: int | str) -> int:
    """Convert a size such as ``"2GiB"`` or ``"1.5GB"`` to a number of bytes.

    Ints are taken as bytes.  Strings are a number, optional spaces and an
    optional case-insensitive unit: ``B``, ``KB``/``MB``/``GB``/``TB`` (SI,
    powers of 1000) or ``KiB``/``MiB``/``GiB``/``TiB`` (IEC, powers of 1024).
    Fractional results are rounded to the nearest byte; a plain byte count
    must be a whole number.

    Raises:
        ValueError: for negative sizes, unknown units or unparsable input.

    Example:
        >>> parse_size("2GiB"), parse_size("1.5GB"), parse_size("100kB"), parse_size(1024)
        (2147483648, 1500000000, 100000, 1024)
    """
    if isinstance(value, bool):
        raise ValueError(f"size must be an int number of bytes or a string, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0 bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"size must be an int number of bytes or a string such as '2GiB', got {value!r}; "
            f"accepted units: {_ACCEPTED_UNITS}"
        )
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            f"cannot parse size {value!r}; expected a number and an optional unit, "
            f"e.g. '512MiB' or '1.5GB'; accepted units: {_ACCEPTED_UNITS}"
        )
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower() if unit else "b")
    if multiplier is None:
        raise ValueError(f"unknown unit {unit!r} in size {value!r}; accepted units: {_ACCEPTED_UNITS}")
    amount = Fraction(number) * multiplier
    if amount < 0:
        raise ValueError(f"size must be >= 0 bytes, got {value!r}")
    if multiplier == 1 and amount.denominator != 1:
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return math.floor(amount + Fraction(1, 2))


def format_bytes(n: int) -> str:
    """Format a byte count with IEC units and two decimals.

    Example:
        >>> [format_bytes(x) for x in (0, 512, 1536, 2 * 1024**3)]
        ['0 B', '512 B', '1.50 KiB', '2.00 GiB']
    """
    n = int(n)
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{n} B"
    unit = 0
    value = float(n)
    while value >= 1024 and unit < len(_IEC) - 1:
        value /= 1024
        unit += 1
    if round(value, 2) >= 1024 and unit < len(_IEC) - 1:  # e.g. 1023.999 KiB -> 1.00 MiB
        value /= 1024
        unit += 1
    return f"{value:.2f} {_IEC[unit]}"


_DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def dtype_size(dtype: Any) -> int:
    name = str(getattr(dtype, "name", dtype))
    if name in _DTYPE_SIZES:
        return _DTYPE_SIZES[name]
    if name.startswith("float8"):
        return 1
    import numpy as np

    try:
        return int(np.dtype(name).itemsize)
    except TypeError:
        return 4


def nbytes(variable: Any) -> int:
    return math.prod(int(d) for d in variable.shape) * dtype_size(variable.dtype)
