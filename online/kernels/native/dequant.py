"""Dequantize a packed weight (or multiply by it, float activations) through the C library: no JIT on the first request.

Example::

    dq = native_dequantizer(weight)          # None where the C library cannot be built/loaded
    out = np.empty(weight.shape, np.float32)
    dq(out) if dq is not None else ...       # out [rows, cols] = weight as float32
    dq.gemv(x, y, threads=2)                 # y [T, rows] = x [T, cols] W^T
"""
from __future__ import annotations

import ctypes

import numpy as np

from tandem.core.errors import TandemError
from ..quantize import Int4Weight
from ..superblocks import Q4KWeight
from . import NativeUnavailable, load_native
from .structs import WeightRef, addr, describe


class NativeDequantizer:
    """One weight's descriptor and the loaded library's ``tdm_dequantize_rows``."""

    def __init__(self, weight, lib: ctypes.CDLL) -> None:
        # int4 is described as a row-dot matrix (the only way it is read); the others as rows
        self._ref: WeightRef = describe(weight, dot_input=isinstance(weight, (Int4Weight, Q4KWeight)))
        self._fn, self._gemv = lib.tdm_dequantize_rows, lib.tdm_gemv_rows
        self.shape = tuple(weight.shape)

    def __call__(self, out: np.ndarray) -> np.ndarray:
        if out.shape != self.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise TandemError(f"dequantize output must be float32 C-contiguous {list(self.shape)}")
        self._fn(ctypes.byref(self._ref.desc), 0, self.shape[0], addr(out))
        return out

    def gemv(self, x: np.ndarray, y: np.ndarray, threads: int) -> np.ndarray:
        """y [T, rows] = x [T, cols] W^T, both float32 C-contiguous (float activations: no quantization)."""
        rows, cols = self.shape
        T = x.shape[0]
        if x.shape != (T, cols) or y.shape != (T, rows) or x.dtype != np.float32 or y.dtype != np.float32 \
                or not (x.flags.c_contiguous and y.flags.c_contiguous):
            raise TandemError(f"gemv needs float32 C-contiguous x [T, {cols}] and y [T, {rows}]")
        self._gemv(ctypes.byref(self._ref.desc), None, rows, T, addr(x), addr(y), max(1, int(threads)))
        return y


def native_dequantizer(weight) -> NativeDequantizer | None:
    """The C dequantizer for ``weight``, or None (library unavailable, or a layout it does not read)."""
    try:
        return NativeDequantizer(weight, load_native().lib)
    except (NativeUnavailable, TandemError):
        return None
