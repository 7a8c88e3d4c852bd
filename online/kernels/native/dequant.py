"""Dequantize a packed weight to float32 through the C library (no JIT on the first prefill).

Example::

    dq = native_dequantizer(weight)          # None where the C library cannot be built/loaded
    out = np.empty(weight.shape, np.float32)
    dq(out) if dq is not None else ...       # out [rows, cols] = weight as float32
"""
from __future__ import annotations

import ctypes

import numpy as np

from tandem.errors import TandemError
from ..quantize import Int4Weight
from . import NativeUnavailable, load_native
from .structs import WeightRef, addr, describe


class NativeDequantizer:
    """One weight's descriptor and the loaded library's ``tdm_dequantize_rows``."""

    def __init__(self, weight, lib: ctypes.CDLL) -> None:
        # int4 is described as a row-dot matrix (the only way it is read); the others as rows
        self._ref: WeightRef = describe(weight, dot_input=isinstance(weight, Int4Weight))
        self._fn = lib.tdm_dequantize_rows
        self.shape = tuple(weight.shape)

    def __call__(self, out: np.ndarray) -> np.ndarray:
        if out.shape != self.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise TandemError(f"dequantize output must be float32 C-contiguous {list(self.shape)}")
        self._fn(ctypes.byref(self._ref.desc), 0, self.shape[0], addr(out))
        return out


def native_dequantizer(weight) -> NativeDequantizer | None:
    """The C dequantizer for ``weight``, or None (library unavailable, or a layout it does not read)."""
    try:
        return NativeDequantizer(weight, load_native().lib)
    except (NativeUnavailable, TandemError):
        return None
