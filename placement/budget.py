"""Byte-size strings: parse ``"2GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"0"``, ``"123456"``; format back.

Example::

    parse_bytes("2GiB")        # 2147483648
    format_bytes(2147483648)   # '2GiB'
    format_bytes(1536 * 2**20) # '1.5GiB'
"""
from __future__ import annotations

import math
import re

from tandem.core.errors import TandemError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """A byte count from a size string (binary units KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB).

    Fractions are rounded down to whole bytes; a size under one byte but not 0 is an error (a missing unit).
    Bad strings raise a one-line TandemError.
    """
    if isinstance(text, bool):
        raise TandemError(f"bad size {text!r}: expected e.g. 2GiB, 512MiB, 1.5GB, 0 or a byte count")
    if isinstance(text, int):
        if text < 0:
            raise TandemError(f"bad size {text}: sizes cannot be negative")
        return text
    match = _PATTERN.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise TandemError(f"bad size {text!r}: expected e.g. 2GiB, 512MiB, 1.5GB, 0 or a byte count")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(value) or value > 2**62:
        raise TandemError(f"bad size {text!r}: too large")
    if 0 < value < 1:  # --gpu-budget 0.5 became a budget of 0 bytes (an all-CPU plan) in silence
        raise TandemError(f"bad size {text!r}: less than one byte (a unit, e.g. {match.group(1)}GiB?)")
    return int(math.floor(value))


def format_bytes(num_bytes: int) -> str:
    """Short exact-ish label: whole binary units when they divide evenly, else one decimal.

    Used in default folder names (``plan-rtx4090-2GiB``), so it never contains spaces or slashes.
    """
    num_bytes = int(num_bytes)
    if num_bytes == 0:
        return "0"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            if num_bytes % scale == 0:
                return f"{num_bytes // scale}{unit}"
            return f"{value:.2f}".rstrip("0").rstrip(".") + unit
    return f"{num_bytes}B"
