"""Triton tiles that read quantized rows as 32-bit words: four Q8_0 codes or eight Q4 nibbles a load instead of a
byte per weight, and one block scale per word instead of one per weight (``kernels.matvec_kernel`` with WORDS, and
``matvec_t_words_kernel`` / ``matvec_t_nibbles_kernel`` for the neuron-major down rows). Where a program's tile is
wide enough (16 rows x 512 columns), each thread's words come as 16-byte loads (tests/test_gpu_compile.py reads the
sm_90 PTX); narrower tiles get 8-byte or 4-byte loads.

The layouts are the tier's (``tier_matrix.TierMatrix``), read through an int32 view of the same bytes:

- Q4_0 / Q4_1: a 32-column block is 16 bytes = 4 words. Word j of a block holds bytes 4j..4j+3; byte t's low
  nibble is column 4j + t and its high nibble column 16 + 4j + t. The block's x values are gathered in that order,
  and the f16 scale (and Q4_1 minimum) multiply each word's partial sum: (dot - 8 sum x) s for Q4_0,
  dot s + m sum x for Q4_1.
- Q8_0: a block is 32 bytes = 8 words; byte t of word k is column 4k + t (a signed code).

Example (what ``Ops.matvec`` launches for a Q4 matrix with ``MatvecLaunch(..., words=True)``)::

    matvec_kernel[(rows // BR,)](x, ..., w.data.view(torch.int32), ..., WORDS=True, BR=16, BC=512)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _xw(x_ptr, norm_ptr, inv, col, C, NORM: tl.constexpr):
    """x'[col] for a [1, W] column index (0 past C): x, or rmsnorm(x) * norm with NORM."""
    v = tl.load(x_ptr + col, mask=col < C, other=0.0)
    if NORM:
        v = v * inv * tl.load(norm_ptr + col, mask=col < C, other=0.0)
    return v


@triton.jit
def _nib(wd, SHIFT: tl.constexpr):
    return ((wd >> SHIFT) & 15).to(tl.float32)


@triton.jit
def _q4_words_part(data, scale, minimum, rows, row_ok, c0, k, x0, x1, x2, x3, x4, x5, x6, x7, xs, sw, ss, C,
                   FMT: tl.constexpr):
    """[BR, W] partial products of Q4 rows (W = BC/8 words of tile c0) with the gathered x's."""
    block = c0 // 32 + k // 4  # [1, W]
    ok = row_ok & (block * 32 < C)
    wd = tl.load(data + rows * sw + c0 // 8 + k, mask=ok, other=0)  # [BR, W] int32
    dot = _nib(wd, 0) * x0 + _nib(wd, 8) * x1 + _nib(wd, 16) * x2 + _nib(wd, 24) * x3
    dot += _nib(wd, 4) * x4 + _nib(wd, 12) * x5 + _nib(wd, 20) * x6 + _nib(wd, 28) * x7
    s = tl.load(scale + rows * ss + block, mask=ok, other=0.0).to(tl.float32)
    if FMT == 3:
        return (dot - 8.0 * xs) * s
    m = tl.load(minimum + rows * ss + block, mask=ok, other=0.0).to(tl.float32)
    return dot * s + m * xs


@triton.jit
def _q8_codes(wd, T: tl.constexpr):
    """Signed byte T of each word, as float."""
    return ((wd << (24 - 8 * T)) >> 24).to(tl.float32)


@triton.jit
def _q8_words_part(data, scale, rows, row_ok, c0, k, x0, x1, x2, x3, sw, ss, C):
    """[BR, W] partial products of Q8_0 rows (W = BC/4 words of tile c0) with the gathered x's."""
    col = c0 + 4 * k  # [1, W]
    ok = row_ok & (col < C)
    wd = tl.load(data + rows * sw + c0 // 4 + k, mask=ok, other=0)  # [BR, W] int32
    dot = _q8_codes(wd, 0) * x0 + _q8_codes(wd, 1) * x1 + _q8_codes(wd, 2) * x2 + _q8_codes(wd, 3) * x3
    return dot * tl.load(scale + rows * ss + col // 32, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def words_tile(acc1, acc2, c0, x_ptr, norm_ptr, inv, d1, s1, m1, d2, s2, m2, rows, row_ok, C, sd1, ss1, sd2, ss2,
               NORM: tl.constexpr, PAIR: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, BC: tl.constexpr):
    """acc += W[rows, c0:c0+BC] x'[c0:c0+BC] (and the pair's) read as words: both Q4 (acc [BR, BC/8]) or both
    Q8_0 (acc [BR, BC/4]); strides ``sd`` in words."""
    if FMT1 == 2:
        k = tl.arange(0, BC // 4)[None, :]  # [1, BC/4] the tile's words
        col = c0 + 4 * k
        x0 = _xw(x_ptr, norm_ptr, inv, col, C, NORM)
        x1 = _xw(x_ptr, norm_ptr, inv, col + 1, C, NORM)
        x2 = _xw(x_ptr, norm_ptr, inv, col + 2, C, NORM)
        x3 = _xw(x_ptr, norm_ptr, inv, col + 3, C, NORM)
        acc1 += _q8_words_part(d1, s1, rows, row_ok, c0, k, x0, x1, x2, x3, sd1, ss1, C)
        if PAIR:
            acc2 += _q8_words_part(d2, s2, rows, row_ok, c0, k, x0, x1, x2, x3, sd2, ss2, C)
    else:
        k = tl.arange(0, BC // 8)[None, :]  # [1, BC/8] the tile's words
        col = c0 + (k // 4) * 32 + (k % 4) * 4  # the word's first low-nibble column
        x0 = _xw(x_ptr, norm_ptr, inv, col, C, NORM)
        x1 = _xw(x_ptr, norm_ptr, inv, col + 1, C, NORM)
        x2 = _xw(x_ptr, norm_ptr, inv, col + 2, C, NORM)
        x3 = _xw(x_ptr, norm_ptr, inv, col + 3, C, NORM)
        x4 = _xw(x_ptr, norm_ptr, inv, col + 16, C, NORM)
        x5 = _xw(x_ptr, norm_ptr, inv, col + 17, C, NORM)
        x6 = _xw(x_ptr, norm_ptr, inv, col + 18, C, NORM)
        x7 = _xw(x_ptr, norm_ptr, inv, col + 19, C, NORM)
        xs = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
        acc1 += _q4_words_part(d1, s1, m1, rows, row_ok, c0, k, x0, x1, x2, x3, x4, x5, x6, x7, xs, sd1, ss1, C,
                               FMT1)
        if PAIR:
            acc2 += _q4_words_part(d2, s2, m2, rows, row_ok, c0, k, x0, x1, x2, x3, x4, x5, x6, x7, xs, sd2, ss2, C,
                                   FMT2)
    return acc1, acc2


@triton.jit
def matvec_t_words_kernel(h_ptr, d1, s1, bias_ptr, y_ptr, R, C, sw, ss1, rows_per_program: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
    """y[c] += sum_r h[r] W[r, c] for a Q8_0 W [R, C] stored neuron-major, read as words (BW words = 4 BW columns
    per program; grid: column blocks x row slices, added atomically; the first slice adds the bias)."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    kw = pid_c * BW + tl.arange(0, BW)  # [BW] word index: columns 4 kw .. 4 kw + 3
    k = kw[None, :]  # [1, BW]
    k_ok = 4 * k < C
    acc0 = tl.zeros([BR, BW], dtype=tl.float32)
    acc1 = tl.zeros([BR, BW], dtype=tl.float32)
    acc2 = tl.zeros([BR, BW], dtype=tl.float32)
    acc3 = tl.zeros([BR, BW], dtype=tl.float32)
    begin = pid_r * rows_per_program
    for r0 in tl.static_range(0, rows_per_program, BR):
        rows = begin + r0 + tl.arange(0, BR)[:, None]  # [BR, 1]
        ok = (rows < R) & k_ok
        hs = tl.load(h_ptr + rows, mask=rows < R, other=0.0) * tl.load(s1 + rows * ss1 + (4 * k) // 32, mask=ok,
                                                                       other=0.0).to(tl.float32)  # [BR, BW]
        wd = tl.load(d1 + rows * sw + k, mask=ok, other=0)  # [BR, BW] int32
        acc0 += _q8_codes(wd, 0) * hs
        acc1 += _q8_codes(wd, 1) * hs
        acc2 += _q8_codes(wd, 2) * hs
        acc3 += _q8_codes(wd, 3) * hs
    c = 4 * kw  # [BW] each word's first column
    _add_column(y_ptr, bias_ptr, c, C, tl.sum(acc0, 0), pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 1, C, tl.sum(acc1, 0), pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 2, C, tl.sum(acc2, 0), pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 3, C, tl.sum(acc3, 0), pid_r, HAS_BIAS)


@triton.jit
def _add_column(y_ptr, bias_ptr, c, C, part, pid_r, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        part += tl.where(pid_r == 0, tl.load(bias_ptr + c, mask=c < C, other=0.0), 0.0)
    tl.atomic_add(y_ptr + c, part, mask=c < C)


@triton.jit
def matvec_t_nibbles_kernel(h_ptr, d1, s1, m1, bias_ptr, y_ptr, R, C, sw, ss1, rows_per_program: tl.constexpr,
                            HAS_BIAS: tl.constexpr, FMT: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
    """``matvec_t_words_kernel`` for Q4_0 / Q4_1 rows: word k of a row holds columns 32 (k // 4) + 4 (k % 4) + t
    (low nibbles) and 16 more (high), t = 0..3; BW words = 8 BW columns per program."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    kw = pid_c * BW + tl.arange(0, BW)  # [BW] word index
    c = (kw // 4) * 32 + (kw % 4) * 4  # [BW] the word's first low-nibble column
    k, col = kw[None, :], c[None, :]  # [1, BW]
    k_ok = col < C
    a0 = tl.zeros([BR, BW], dtype=tl.float32)
    a1 = tl.zeros([BR, BW], dtype=tl.float32)
    a2 = tl.zeros([BR, BW], dtype=tl.float32)
    a3 = tl.zeros([BR, BW], dtype=tl.float32)
    a4 = tl.zeros([BR, BW], dtype=tl.float32)
    a5 = tl.zeros([BR, BW], dtype=tl.float32)
    a6 = tl.zeros([BR, BW], dtype=tl.float32)
    a7 = tl.zeros([BR, BW], dtype=tl.float32)
    am = tl.zeros([BR, BW], dtype=tl.float32)  # Q4_0: -8 sum h s; Q4_1: sum h m (every column of the word)
    begin = pid_r * rows_per_program
    for r0 in tl.static_range(0, rows_per_program, BR):
        rows = begin + r0 + tl.arange(0, BR)[:, None]  # [BR, 1]
        ok = (rows < R) & k_ok
        hv = tl.load(h_ptr + rows, mask=rows < R, other=0.0)  # [BR, 1]
        hs = hv * tl.load(s1 + rows * ss1 + k // 4, mask=ok, other=0.0).to(tl.float32)  # [BR, BW]
        if FMT == 3:
            am += -8.0 * hs
        else:
            am += hv * tl.load(m1 + rows * ss1 + k // 4, mask=ok, other=0.0).to(tl.float32)
        wd = tl.load(d1 + rows * sw + k, mask=ok, other=0)  # [BR, BW] int32
        a0 += _nib(wd, 0) * hs
        a1 += _nib(wd, 8) * hs
        a2 += _nib(wd, 16) * hs
        a3 += _nib(wd, 24) * hs
        a4 += _nib(wd, 4) * hs
        a5 += _nib(wd, 12) * hs
        a6 += _nib(wd, 20) * hs
        a7 += _nib(wd, 28) * hs
    m = tl.sum(am, 0)
    _add_column(y_ptr, bias_ptr, c, C, tl.sum(a0, 0) + m, pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 1, C, tl.sum(a1, 0) + m, pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 2, C, tl.sum(a2, 0) + m, pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 3, C, tl.sum(a3, 0) + m, pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 16, C, tl.sum(a4, 0) + m, pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 17, C, tl.sum(a5, 0) + m, pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 18, C, tl.sum(a6, 0) + m, pid_r, HAS_BIAS)
    _add_column(y_ptr, bias_ptr, c + 19, C, tl.sum(a7, 0) + m, pid_r, HAS_BIAS)
