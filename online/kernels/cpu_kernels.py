"""The module path's CPU kernels for a few tokens, in the C library (native/module.h): GEMV over listed
rows, the sparse down projection and the fused FFN, with float activations (no int8 quantization of x,
unlike the fused decode step), over every packed format. Rows split over ``threads`` OpenMP chunks.

A weight reaches the kernels as ``kernel_weight(w)`` (its C descriptor, built once and kept by the
caller); every function raises ``NativeUnavailable`` (a TandemError) where the C library cannot be
built, and callers then take the dequantize + torch path.

Example::

    th = clamp_threads(2)
    y = np.empty((1, 1536), np.float32)
    gemv_rows(kernel_weight(quantize_int8(w)), None, x, y, th)      # x float32 [1, 576]; None: every row
    count = ffn_fused(kernel_weight(g), kernel_weight(u), kernel_weight(dT), x, ACT_IDS["silu"], 0.0, 0.05,
                      None, None, None, y, th)
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from tandem.core.errors import TandemError
from .native import NativeUnavailable, load_native
from .native.structs import WeightRef, addr, describe
from tandem.core.cpus import usable_cpus

from .quantize import ACT_IDS, Int4Weight
from .superblocks import GGUFBlockWeight, Q4KWeight

__all__ = ["ACT_IDS", "NativeUnavailable", "clamp_threads", "dequantize_into", "down_sparse", "ffn_fused",
           "gemv_rows", "kernel_weight", "native_available"]


def clamp_threads(threads: int) -> int:
    """A thread count the kernels run: 1 .. the CPUs this process may use."""
    return max(1, min(int(threads), usable_cpus()))


def native_available() -> bool:
    try:
        load_native()
        return True
    except NativeUnavailable:
        return False


def kernel_weight(w) -> WeightRef:
    """The C descriptor of any packed weight (int4 / Q4_K / GGUF blocks as row-dot matrices, the rest as plain rows:
    the module kernels read every format both ways)."""
    return describe(w, dot_input=isinstance(w, (Int4Weight, Q4KWeight, GGUFBlockWeight)))


@functools.cache
def _lib() -> ctypes.CDLL:
    """The loaded library, once per process (load_native hashes the sources: ~0.7 ms, too much per call)."""
    return load_native().lib


def _check(a: np.ndarray, shape: tuple, what: str) -> None:
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == shape and a.flags.c_contiguous):
        raise TandemError(f"{what}: expected a float32 C-contiguous array {list(shape)}")


def _rows(rows, n_rows: int) -> tuple[int, np.ndarray | None]:
    if rows is None:
        return n_rows, None
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= n_rows)):
        raise TandemError(f"row indices must be a 1-D list in [0, {n_rows})")
    return rows.size, rows


def _vec(b, n: int, what: str) -> np.ndarray | None:
    if b is None or b.size == 0:
        return None
    _check(b, (n,), what)
    return b


def gemv_rows(w: WeightRef, rows, x: np.ndarray, y: np.ndarray, threads: int) -> np.ndarray:
    """y [T, len(rows)] = x [T, in] @ W[rows]^T (rows None: every row); only the listed rows are read."""
    out_f, in_f = w.desc.rows, w.desc.cols
    n, idx = _rows(rows, out_f)
    T = x.shape[0] if x.ndim == 2 else -1
    _check(x, (T, in_f), "gemv input")
    _check(y, (T, n), "gemv output")
    if T and n and _lib().tdm_gemv_rows(ctypes.byref(w.desc), addr(idx), n, T, addr(x), addr(y), threads) < 0:
        raise TandemError("gemv: out of memory")
    return y


def ffn_fused(gate: WeightRef | None, up: WeightRef, down_t: WeightRef, x: np.ndarray, act: int, alpha: float,
              threshold: float, gate_bias, up_bias, rows, y: np.ndarray, threads: int) -> int:
    """One FFN for T tokens in one parallel region. For each neuron i in ``rows`` (None: all):
    h = act(gate_i . x + gb_i) * (up_i . x + ub_i) (gate None: act(up_i . x + ub_i)); where |h| > threshold,
    y += h * down_t[i]. threshold < 0 keeps every listed neuron. Returns the (token, neuron) pairs used."""
    n_ff, d = down_t.desc.rows, down_t.desc.cols
    n, idx = _rows(rows, n_ff)
    T = x.shape[0] if x.ndim == 2 else -1
    _check(x, (T, up.desc.cols), "FFN input")
    _check(y, (T, d), "FFN output")
    gb, ub = _vec(gate_bias, n_ff, "gate bias"), _vec(up_bias, n_ff, "up bias")
    count = _lib().tdm_ffn_fused(ctypes.byref(gate.desc) if gate is not None else None, ctypes.byref(up.desc),
                                 ctypes.byref(down_t.desc), T, addr(x), None, int(act), float(alpha),
                                 float(threshold), addr(gb), addr(ub), addr(idx), n, addr(y), threads)
    if count < 0:
        raise TandemError("FFN: out of memory")
    return int(count)


def down_sparse(wt: WeightRef, h: np.ndarray, threshold: float, y: np.ndarray, threads: int) -> int:
    """y [T, d] = sum over neurons i with |h[t, i]| > threshold of h[t, i] * wt[i] (wt: the transposed
    down projection [n_ff, d]). Returns how many (token, neuron) pairs were used."""
    n_ff, d = wt.desc.rows, wt.desc.cols
    T = h.shape[0] if h.ndim == 2 else -1
    _check(h, (T, n_ff), "down input")
    _check(y, (T, d), "down output")
    count = _lib().tdm_ffn_fused(None, None, ctypes.byref(wt.desc), T, None, addr(h), 0, 0.0, float(threshold),
                                 None, None, None, n_ff, addr(y), threads)
    if count < 0:
        raise TandemError("down projection: out of memory")
    return int(count)


def dequantize_into(w: WeightRef, out: np.ndarray) -> np.ndarray:
    """out [rows, in] float32 = the weight's float values (one thread: prefill alternates this with torch)."""
    _check(out, (w.desc.rows, w.desc.cols), "dequantize output")
    _lib().tdm_dequantize_rows(ctypes.byref(w.desc), 0, w.desc.rows, addr(out))
    return out
