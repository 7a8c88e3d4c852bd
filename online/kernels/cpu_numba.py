"""Numba CPU kernels for one token (or a few): GEMV, row-sparse GEMV, sparse down projection, fused FFN.

A weight reaches the kernels as the tuple ``Weight.kernel_args()`` gives:
``(kind, data uint8 [rows, row_bytes], scale f32 2-D, minimum f32 2-D, group)`` with kind one of
quantize.KIND_F32 / KIND_F16 / KIND_I8 (per-row scale) / KIND_I8B (per-32-block scale, Q8_0) / KIND_I4
(Q4_1-style groups of 32 or 64). One compiled specialisation per kernel serves every format.

Row dot products and row axpys for the blocked formats are small LLVM-IR functions with explicit
vector types (linked into the numba code through ``intrinsic``): numba's auto-vectoriser turns
nested 32-element block loops into scalar or gather code, 4-10x slower. fp32 and per-row int8 use
plain numba loops, which vectorise well. Parallel kernels split rows over ``threads`` static chunks
(one ``prange`` region per call: ~3 us with the OpenMP layer, ~45 us with numba's workqueue layer)
and set numba's thread count themselves (``threads`` <= NUMBA_NUM_THREADS: see ``clamp_threads``).
The down projection accumulates per-chunk partial sums, reduced afterwards, so there are no races.

The IR lives in numba_ir.py. numba's on-disk cache only checks this file's timestamp, so this file pins
numba_ir.py's digest (IR_DIGEST): an edit there must update it here, which also refreshes the cache.

Example::

    th = clamp_threads(2)
    y = np.empty((1, 1536), np.float32)
    gemv_rows(quantize_int8(w).kernel_args(), np.arange(1536), x, y, th)   # x float32 [1, 576]
    count = ffn_fused(g.kernel_args(), u.kernel_args(), dT.kernel_args(), x, ACT_IDS["silu"], 0.0,
                      0.05, True, EMPTY_F32, EMPTY_F32, np.arange(1536), y, th)
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
from numba import njit, prange

from . import numba_ir
from .numba_ir import (_axpy_f16, _axpy_i8b32, _axpy_q4g32, _axpy_q4g64, _deq_f16, _deq_i8b32, _deq_q4g32,
                       _deq_q4g64, _dot_f16, _dot_i8b32, _dot_q4g32, _dot_q4g64, _set_num_threads, clamp_threads,
                       set_threads)
from .quantize import ACT_IDS, F16_VECTOR, KIND_F16, KIND_F32, KIND_I4, KIND_I8, KIND_I8B

IR_DIGEST = "48480c0c2fc990c70360f0e4fe3ece4b352f3b90a08243b797fcf74b1b3190fa"  # sha256 of numba_ir.py: see the module docstring
if hashlib.sha256(Path(numba_ir.__file__).read_bytes()).hexdigest() != IR_DIGEST:
    raise ImportError("online/kernels/numba_ir.py changed: set IR_DIGEST in online/kernels/cpu_numba.py to its new "
                      "sha256 (this file's timestamp keys numba's on-disk cache of the kernels that inline that IR)")
__all__ = ["ACT_IDS", "clamp_threads", "dequantize_into", "down_sparse", "ffn_fused", "gemv_rows", "set_threads"]
EMPTY_F32 = np.zeros(0, dtype=np.float32)
EMPTY_F32.setflags(write=False)


def _jit(parallel: bool = False, inline: bool = False):
    """njit(fastmath, cache) that falls back to no disk cache where no cache dir is writable.
    Helpers are inlined at numba level: a real call would incref/decref every array per row."""
    opts = dict(parallel=parallel, fastmath=True, nogil=True, inline="always" if inline else "never")

    def deco(fn):
        try:
            return njit(cache=True, **opts)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return njit(cache=False, **opts)(fn)
    return deco


# ----------------------------------------------------------------------------------------------
# Serial building blocks, inlined into the parallel kernels. Each format has its own loop nest
# (a format branch inside the row loop costs LLVM its vectorisation choices), and no array views
# are made per row (each view is an atomic incref/decref, and both threads hit the same counter).

@_jit(inline=True)
def _addr(a):
    return np.uint64(a.ctypes.data)


@_jit(inline=True)
def _at(base, i, stride):
    """Address of row i: base + i * stride (bytes), kept in uint64 (int64 + uint64 is float64 in numba)."""
    return base + np.uint64(i * stride)


@_jit(inline=True)
def _dots(w, rows, lo, hi, x, xs, out, ooff):
    """out[t, j - ooff] = W[rows[j]] . x[t] for j in [lo, hi) and every token t (xs: int4 group sums)."""
    kind, data, scale, minimum, group = w
    T = x.shape[0]
    if kind == KIND_F32:
        wf = data.view(np.float32)
        for j in range(lo, hi):
            r = rows[j]
            for t in range(T):
                a0 = np.float32(0.0)
                for k in range(wf.shape[1]):
                    a0 += wf[r, k] * x[t, k]
                out[t, j - ooff] = a0
    elif kind == KIND_I8:
        q = data.view(np.int8)
        for j in range(lo, hi):
            r = rows[j]
            for t in range(T):
                a1 = np.float32(0.0)
                for k in range(q.shape[1]):
                    a1 += np.float32(q[r, k]) * x[t, k]
                out[t, j - ooff] = a1 * scale[r, 0]
    elif kind == KIND_F16:
        pd, px, sd, sx = _addr(data), _addr(x), data.strides[0], x.strides[0]
        nv = data.shape[1] // (2 * F16_VECTOR)
        for j in range(lo, hi):
            r = rows[j]
            for t in range(T):
                out[t, j - ooff] = _dot_f16(_at(pd, r, sd), _at(px, t, sx), nv)
    else:
        pd, ps, pm, px, pxs = _addr(data), _addr(scale), _addr(minimum), _addr(x), _addr(xs)
        sd, ss, sx, sxs = data.strides[0], scale.strides[0], x.strides[0], xs.strides[0]
        n = scale.shape[1]
        for j in range(lo, hi):
            r = rows[j]
            for t in range(T):
                if kind == KIND_I8B:
                    v = _dot_i8b32(_at(pd, r, sd), _at(ps, r, ss), _at(px, t, sx), n)
                elif group == 32:
                    v = _dot_q4g32(_at(pd, r, sd), _at(ps, r, ss), _at(pm, r, ss), _at(px, t, sx), _at(pxs, t, sxs), n)
                else:
                    v = _dot_q4g64(_at(pd, r, sd), _at(ps, r, ss), _at(pm, r, ss), _at(px, t, sx), _at(pxs, t, sxs), n)
                out[t, j - ooff] = v


@_jit(inline=True)
def _axpys(w, rows, lo, hi, h, hoff, threshold, acc):
    """acc[t] += h[t, j - hoff] * W[rows[j]] for j in [lo, hi) where |h| > threshold; returns the
    number of (token, row) pairs used. W's rows are neurons (a transposed down projection).
    fp32 / int8 rows go four at a time, so acc is loaded and stored once per four rows."""
    kind, data, scale, minimum, group = w
    sel_r = np.empty(hi - lo, dtype=np.int64)
    sel_v = np.empty(hi - lo, dtype=np.float32)
    cnt = 0
    for t in range(h.shape[0]):
        m = 0
        for j in range(lo, hi):
            v = h[t, j - hoff]
            if abs(v) > threshold:
                sel_r[m] = rows[j]
                sel_v[m] = v
                m += 1
        cnt += m
        if kind == KIND_F32:
            wf = data.view(np.float32)
            j = 0
            while j + 4 <= m:
                r0, r1, r2, r3 = sel_r[j], sel_r[j + 1], sel_r[j + 2], sel_r[j + 3]
                v0, v1, v2, v3 = sel_v[j], sel_v[j + 1], sel_v[j + 2], sel_v[j + 3]
                for k in range(wf.shape[1]):
                    acc[t, k] += (v0 * wf[r0, k] + v1 * wf[r1, k]) + (v2 * wf[r2, k] + v3 * wf[r3, k])
                j += 4
            for jj in range(j, m):  # the last 0-3 rows
                r, v = sel_r[jj], sel_v[jj]
                for k in range(wf.shape[1]):
                    acc[t, k] += v * wf[r, k]
        elif kind == KIND_I8:
            q = data.view(np.int8)
            j = 0
            while j + 4 <= m:
                r0, r1, r2, r3 = sel_r[j], sel_r[j + 1], sel_r[j + 2], sel_r[j + 3]
                a0, a1 = sel_v[j] * scale[r0, 0], sel_v[j + 1] * scale[r1, 0]
                a2, a3 = sel_v[j + 2] * scale[r2, 0], sel_v[j + 3] * scale[r3, 0]
                for k in range(q.shape[1]):
                    acc[t, k] += ((a0 * np.float32(q[r0, k]) + a1 * np.float32(q[r1, k]))
                                  + (a2 * np.float32(q[r2, k]) + a3 * np.float32(q[r3, k])))
                j += 4
            for jj in range(j, m):
                r = sel_r[jj]
                a = sel_v[jj] * scale[r, 0]
                for k in range(q.shape[1]):
                    acc[t, k] += a * np.float32(q[r, k])
        elif kind == KIND_F16:
            pd, py, sd, sy = _addr(data), _addr(acc), data.strides[0], acc.strides[0]
            nv = data.shape[1] // (2 * F16_VECTOR)
            for jj in range(m):
                _axpy_f16(_at(py, t, sy), _at(pd, sel_r[jj], sd), sel_v[jj], nv)
        else:
            pd, ps, pm, py = _addr(data), _addr(scale), _addr(minimum), _addr(acc)
            sd, ss, sy = data.strides[0], scale.strides[0], acc.strides[0]
            n = scale.shape[1]
            for jj in range(m):
                r, v = sel_r[jj], sel_v[jj]
                if kind == KIND_I8B:
                    _axpy_i8b32(_at(py, t, sy), _at(pd, r, sd), _at(ps, r, ss), v, n)
                elif group == 32:
                    _axpy_q4g32(_at(py, t, sy), _at(pd, r, sd), _at(ps, r, ss), _at(pm, r, ss), v, n)
                else:
                    _axpy_q4g64(_at(py, t, sy), _at(pd, r, sd), _at(ps, r, ss), _at(pm, r, ss), v, n)
    return cnt


@_jit(inline=True)
def _group_sums(w, x):
    """[T, groups] sums of x over w's int4 groups (for the minimum term); [T, 1] zeros otherwise."""
    kind, data, scale, minimum, group = w
    if kind != KIND_I4:
        return np.zeros((x.shape[0], 1), dtype=np.float32)
    n = scale.shape[1]
    xs = np.zeros((x.shape[0], n), dtype=np.float32)
    for t in range(x.shape[0]):
        for g in range(n):
            a = np.float32(0.0)
            for k in range(g * group, (g + 1) * group):
                a += x[t, k]
            xs[t, g] = a
    return xs


@_jit(inline=True)
def _act(act, alpha, g, u):
    """h for one neuron: act(g) * u (dReLU: relu(g) * relu(u)); plain FFNs pass g = u, u = 1."""
    if act == 0:
        return np.float32(g / (np.float32(1.0) + np.float32(math.exp(-g))) * u)
    if act == 1:
        return np.float32(max(g, np.float32(0.0)) * u)
    if act == 2:
        return np.float32(g * u) if g > alpha else np.float32(0.0)
    if act == 3:
        return np.float32(max(g, np.float32(0.0)) * max(u, np.float32(0.0)))
    if act == 4:
        return np.float32(np.float32(0.5) * g * (np.float32(1.0) + np.float32(math.erf(g * np.float32(0.7071067811865476)))) * u)
    inner = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
    return np.float32(np.float32(0.5) * g * (np.float32(1.0) + np.float32(math.tanh(inner))) * u)


@_jit(inline=True)
def _chunk(n, c, parts):
    return (n * c) // parts, (n * (c + 1)) // parts


@_jit(inline=True)
def _reduce(partial, y):
    """y [T, d] = sum over chunks of partial [chunks, T, d]."""
    for t in range(y.shape[0]):
        for k in range(y.shape[1]):
            a = np.float32(0.0)
            for c in range(partial.shape[0]):
                a += partial[c, t, k]
            y[t, k] = a


# ----------------------------------------------------------------------------------------------
# Parallel kernels (one prange region each; ``threads`` static chunks)

@_jit(parallel=True)
def gemv_rows(w, rows, x, y, threads):
    """y [T, len(rows)] = x [T, in] @ W[rows]^T: only the listed rows are read (rows = arange: dense)."""
    _set_num_threads(threads)
    xs = _group_sums(w, x)
    n = rows.shape[0]
    for c in prange(threads):
        lo, hi = _chunk(n, c, threads)
        _dots(w, rows, lo, hi, x, xs, y, 0)


@_jit(parallel=True)
def down_sparse(wt, h, threshold, y, threads):
    """y [T, d] = sum over neurons i with |h[t, i]| > threshold of h[t, i] * wt[i] (wt: transposed
    down projection [n_ff, d]). Returns how many (token, neuron) pairs were used."""
    _set_num_threads(threads)
    n = h.shape[1]
    rows = np.arange(n)
    partial = np.zeros((threads, y.shape[0], y.shape[1]), dtype=np.float32)
    counts = np.zeros(threads, dtype=np.int64)
    for c in prange(threads):
        lo, hi = _chunk(n, c, threads)
        counts[c] = _axpys(wt, rows, lo, hi, h, 0, threshold, partial[c])
    _reduce(partial, y)
    return counts.sum()


@_jit(parallel=True)
def ffn_fused(gate, up, down_t, x, act, alpha, threshold, gated, gate_bias, up_bias, rows, y, threads):
    """One FFN for T tokens in one parallel region. For each neuron i in ``rows``:
    h = act(gate_i . x + gb_i) * (up_i . x + ub_i) (plain FFN, gated=False: act(up_i . x + ub_i));
    where |h| > threshold, y += h * down_t[i]. threshold < 0 keeps every listed neuron (dense, or
    predictor-gated rows). Biases are empty arrays when absent. Returns the (token, neuron) pairs used."""
    _set_num_threads(threads)
    T = x.shape[0]
    xs_g = _group_sums(gate, x)
    xs_u = _group_sums(up, x)
    n = rows.shape[0]
    partial = np.zeros((threads, T, y.shape[1]), dtype=np.float32)
    counts = np.zeros(threads, dtype=np.int64)
    for c in prange(threads):
        lo, hi = _chunk(n, c, threads)
        hu = np.empty((T, hi - lo), dtype=np.float32)
        _dots(up, rows, lo, hi, x, xs_u, hu, lo)
        hg = np.empty((T, hi - lo), dtype=np.float32)
        if gated:
            _dots(gate, rows, lo, hi, x, xs_g, hg, lo)
        for j in range(hi - lo):
            i = rows[lo + j]
            for t in range(T):
                u = hu[t, j]
                if up_bias.shape[0] > 0:
                    u += up_bias[i]
                if gated:
                    g = hg[t, j]
                    if gate_bias.shape[0] > 0:
                        g += gate_bias[i]
                    hu[t, j] = _act(act, alpha, g, u)
                else:
                    hu[t, j] = _act(act, alpha, u, np.float32(1.0))
        counts[c] = _axpys(down_t, rows, lo, hi, hu, lo, threshold, partial[c])
    _reduce(partial, y)
    return counts.sum()


@_jit(parallel=True)
def dequantize_into(w, out, threads):
    """out [rows, in] float32 = the weight's float values (T > 1 matmuls, references)."""
    _set_num_threads(threads)
    kind, data, scale, minimum, group = w
    n, cols = out.shape
    for c in prange(threads):
        lo, hi = _chunk(n, c, threads)
        if kind == KIND_F32:
            wf = data.view(np.float32)
            for r in range(lo, hi):
                for k in range(cols):
                    out[r, k] = wf[r, k]
        elif kind == KIND_I8:
            q = data.view(np.int8)
            for r in range(lo, hi):
                for k in range(cols):
                    out[r, k] = np.float32(q[r, k]) * scale[r, 0]
        elif kind == KIND_F16:
            po, pd, so, sd = _addr(out), _addr(data), out.strides[0], data.strides[0]
            for r in range(lo, hi):
                _deq_f16(_at(po, r, so), _at(pd, r, sd), cols // F16_VECTOR)
        else:
            po, pd, ps, pm = _addr(out), _addr(data), _addr(scale), _addr(minimum)
            so, sd, ss = out.strides[0], data.strides[0], scale.strides[0]
            nb = scale.shape[1]
            for r in range(lo, hi):
                if kind == KIND_I8B:
                    _deq_i8b32(_at(po, r, so), _at(pd, r, sd), _at(ps, r, ss), nb)
                elif group == 32:
                    _deq_q4g32(_at(po, r, so), _at(pd, r, sd), _at(ps, r, ss), _at(pm, r, ss), nb)
                else:
                    _deq_q4g64(_at(po, r, so), _at(pd, r, sd), _at(ps, r, ss), _at(pm, r, ss), nb)
