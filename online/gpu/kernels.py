"""Triton kernels of the GPU decode step, reading the tier's formats as they are stored
(``tier_matrix.TierMatrix``): fp32, fp16, Q8_0 codes, Q4_0 / Q4_1 nibbles (GGUF order: a 32-column
block is 16 bytes, low nibbles the first 16 columns, high nibbles the next 16) with f16 block scales.

Every kernel reads the position and token from device memory, so a captured CUDA graph replays them
for any position. Imported only where Triton is (``ops`` falls back to torch elsewhere); with
``TRITON_INTERPRET=1`` they run on CPU tensors, which is how the tests check them without a GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels_words import matvec_t_nibbles_kernel, matvec_t_words_kernel, words_tile  # noqa: F401 (launched here)

FORMAT_IDS = {"fp32": 0, "fp16": 1, "q8": 2, "q4": 3, "q4_1": 4}
ACT_IDS = {"none": 0, "silu": 1, "gelu_tanh": 2, "relu": 3, "gelu": 4}


@triton.jit
def _load_w(data, scale, minimum, rows, cols, ok, stride_data, stride_scale, FMT: tl.constexpr):
    """float32 tile of W[rows, cols] (rows [BR, 1] / cols [1, BC] or any broadcastable pair)."""
    if FMT == 0:
        w = tl.load(data + rows * stride_data + cols, mask=ok, other=0.0)
    elif FMT == 1:
        w = tl.load(data + rows * stride_data + cols, mask=ok, other=0.0).to(tl.float32)
    elif FMT == 2:
        q = tl.load(data + rows * stride_data + cols, mask=ok, other=0).to(tl.float32)
        s = tl.load(scale + rows * stride_scale + cols // 32, mask=ok, other=0.0).to(tl.float32)
        w = q * s
    else:
        byte = tl.load(data + rows * stride_data + (cols // 32) * 16 + (cols % 16), mask=ok, other=0).to(tl.int32)
        code = ((byte >> (((cols % 32) // 16) * 4)) & 15).to(tl.float32)
        s = tl.load(scale + rows * stride_scale + cols // 32, mask=ok, other=0.0).to(tl.float32)
        if FMT == 3:
            w = (code - 8.0) * s
        else:
            m = tl.load(minimum + rows * stride_scale + cols // 32, mask=ok, other=0.0).to(tl.float32)
            w = code * s + m
    return w


@triton.jit
def _act(y, ACT: tl.constexpr):
    if ACT == 1:
        y = y / (1.0 + tl.exp(-y))
    elif ACT == 2:
        inner = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = 0.5 * y * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    elif ACT == 3:
        y = tl.maximum(y, 0.0)
    elif ACT == 4:
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    return y


@triton.jit
def _q4_packed_part(data, scale, minimum, rows, row_ok, c0, xl, xh, sd, ss, C, FMT: tl.constexpr, BC: tl.constexpr):
    """Q4_0 / Q4_1 rows' products with x over the tile's BC columns, read as its BC/2 stored bytes (one contiguous
    load; byte k of a 32-column block holds column k (low nibble) and k + 16 (high)): [BR, BC/2]."""
    k = tl.arange(0, BC // 2)[None, :]  # [1, BC/2] the tile's bytes
    block = (c0 + (k // 16) * 32) // 32
    ok = row_ok & (block * 32 < C)
    b = tl.load(data + rows * sd + c0 // 2 + k, mask=ok, other=0).to(tl.int32)  # [BR, BC/2]
    lo = (b & 15).to(tl.float32)
    hi = ((b >> 4) & 15).to(tl.float32)
    s = tl.load(scale + rows * ss + block, mask=ok, other=0.0).to(tl.float32)
    if FMT == 3:
        part = ((lo - 8.0) * xl + (hi - 8.0) * xh) * s
    else:
        m = tl.load(minimum + rows * ss + block, mask=ok, other=0.0).to(tl.float32)
        part = (lo * xl + hi * xh) * s + m * (xl + xh)
    return part


@triton.jit
def _matvec_tile(acc1, acc2, c0, x_ptr, norm_ptr, inv, d1, s1, m1, d2, s2, m2, rows, row_ok, C, sd1, ss1, sd2, ss2,
                 NORM: tl.constexpr, PAIR: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, BC: tl.constexpr,
                 PACKED: tl.constexpr = False, WORDS: tl.constexpr = False):
    """acc += W[rows, c0:c0+BC] * x'[c0:c0+BC] (and the pair's); PACKED (both Q4): the bytes read whole; WORDS
    (both Q4, or both Q8_0): read as 32-bit words (``kernels_words``). One return after if / elif / else: Triton
    type-checks the code after a return inside a constexpr branch, so an early return with another tile shape
    does not compile for a GPU (the interpreter runs it; tests/test_gpu_compile.py compiles for sm_90)."""
    if WORDS:
        acc1, acc2 = words_tile(acc1, acc2, c0, x_ptr, norm_ptr, inv, d1, s1, m1, d2, s2, m2, rows, row_ok, C, sd1,
                                ss1, sd2, ss2, NORM, PAIR, FMT1, FMT2, BC)
    elif PACKED:
        k = tl.arange(0, BC // 2)[None, :]  # [1, BC/2]
        il = c0 + (k // 16) * 32 + k % 16  # the low nibbles' columns; the high ones' are 16 on
        ih = il + 16
        xl = tl.load(x_ptr + il, mask=il < C, other=0.0)
        xh = tl.load(x_ptr + ih, mask=ih < C, other=0.0)
        if NORM:
            xl = xl * inv * tl.load(norm_ptr + il, mask=il < C, other=0.0)
            xh = xh * inv * tl.load(norm_ptr + ih, mask=ih < C, other=0.0)
        acc1 += _q4_packed_part(d1, s1, m1, rows, row_ok, c0, xl, xh, sd1, ss1, C, FMT1, BC)
        if PAIR:
            acc2 += _q4_packed_part(d2, s2, m2, rows, row_ok, c0, xl, xh, sd2, ss2, C, FMT2, BC)
    else:
        cols = c0 + tl.arange(0, BC)[None, :]  # [1, BC]
        col_ok = cols < C
        xv = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        if NORM:
            xv = xv * inv * tl.load(norm_ptr + cols, mask=col_ok, other=0.0)
        ok = row_ok & col_ok
        acc1 += _load_w(d1, s1, m1, rows, cols, ok, sd1, ss1, FMT1) * xv
        if PAIR:
            acc2 += _load_w(d2, s2, m2, rows, cols, ok, sd2, ss2, FMT2) * xv
    return acc1, acc2


@triton.jit
def matvec_kernel(x_ptr, norm_ptr, eps, d1, s1, m1, b1, d2, s2, m2, b2, res_ptr, y_ptr, R, C: tl.constexpr,
                  sd1, ss1, sd2, ss2, NORM: tl.constexpr, PAIR: tl.constexpr, ACT: tl.constexpr,
                  RESIDUAL: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr,
                  FMT1: tl.constexpr, FMT2: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                  ROLLED: tl.constexpr = False, PACKED: tl.constexpr = False, WORDS: tl.constexpr = False):
    """y[r] = act(W2 x')[r] * (W1 x')[r] (PAIR) or act(W1 x')[r], + res[r] (RESIDUAL); x' = rmsnorm(x) * norm
    (NORM) else x. W [R, C] in FMT; one program per BR rows; the column loop unrolled, or a loop (ROLLED); Q4
    rows (both of a pair) read byte-wise whole with PACKED, or quantized rows as 32-bit words with WORDS (the
    data pointers then int32 views, strides in words)."""
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)[:, None]  # [BR, 1]
    row_ok = rows < R
    inv = 1.0
    if NORM:
        sq = tl.zeros([BC], dtype=tl.float32)
        for c0 in tl.static_range(0, C, BC):  # unrolled: every load issued at once
            c = c0 + tl.arange(0, BC)
            v = tl.load(x_ptr + c, mask=c < C, other=0.0)
            sq += v * v
        inv = 1.0 / tl.sqrt(tl.sum(sq, 0) / C + eps)
    WIDTH: tl.constexpr = (BC // 4 if FMT1 == 2 else BC // 8) if WORDS else (BC // 2 if PACKED else BC)
    acc1 = tl.zeros([BR, WIDTH], dtype=tl.float32)
    acc2 = tl.zeros([BR, WIDTH], dtype=tl.float32)
    if ROLLED:
        for c0 in tl.range(0, C, BC):
            acc1, acc2 = _matvec_tile(acc1, acc2, c0, x_ptr, norm_ptr, inv, d1, s1, m1, d2, s2, m2, rows, row_ok, C,
                                      sd1, ss1, sd2, ss2, NORM, PAIR, FMT1, FMT2, BC, PACKED, WORDS)
    else:
        for c0 in tl.static_range(0, C, BC):
            acc1, acc2 = _matvec_tile(acc1, acc2, c0, x_ptr, norm_ptr, inv, d1, s1, m1, d2, s2, m2, rows, row_ok, C,
                                      sd1, ss1, sd2, ss2, NORM, PAIR, FMT1, FMT2, BC, PACKED, WORDS)
    r = pid * BR + tl.arange(0, BR)
    r_ok = r < R
    y = tl.sum(acc1, 1)  # [BR]
    if HAS_B1:
        y += tl.load(b1 + r, mask=r_ok, other=0.0)
    if PAIR:
        g = tl.sum(acc2, 1)
        if HAS_B2:
            g += tl.load(b2 + r, mask=r_ok, other=0.0)
        y = _act(g, ACT) * y
    else:
        y = _act(y, ACT)
    if RESIDUAL:
        y += tl.load(res_ptr + r, mask=r_ok, other=0.0)
    tl.store(y_ptr + r, y, mask=r_ok)


@triton.jit
def matvec_t_kernel(h_ptr, d1, s1, m1, bias_ptr, y_ptr, R, C, sd1, ss1, rows_per_program: tl.constexpr,
                    HAS_BIAS: tl.constexpr, FMT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """y[c] += sum_r h[r] W[r, c] (W [R, C]: a down projection stored neuron-major) over a slice of rows per
    program (grid: column blocks x row slices), added atomically; the first slice adds the bias."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols = pid_c * BC + tl.arange(0, BC)[None, :]  # [1, BC]
    col_ok = cols < C
    acc = tl.zeros([BR, BC], dtype=tl.float32)
    begin = pid_r * rows_per_program
    for r0 in tl.static_range(0, rows_per_program, BR):
        rows = begin + r0 + tl.arange(0, BR)[:, None]  # [BR, 1]
        row_ok = rows < R
        hv = tl.load(h_ptr + rows, mask=row_ok, other=0.0)
        acc += _load_w(d1, s1, m1, rows, cols, row_ok & col_ok, sd1, ss1, FMT) * hv
    c = pid_c * BC + tl.arange(0, BC)
    part = tl.sum(acc, 0)  # [BC]
    if HAS_BIAS:
        part += tl.where(pid_r == 0, tl.load(bias_ptr + c, mask=c < C, other=0.0), 0.0)
    tl.atomic_add(y_ptr + c, part, mask=c < C)


@triton.jit
def _heads(ptr, heads, n, d, pos, cos_ptr, sin_ptr, norm_ptr, eps, ROPE: tl.constexpr, NORM: tl.constexpr,
           HD: tl.constexpr):
    """Heads ``heads`` [BH, 1] (< n) of a [n, HD] vector at ``ptr``: RMS-normed per head (NORM: Qwen3 / Gemma 3's
    q/k norms) then rotated (ROPE) at position ``pos``. Returns ([BH, HD] values, their mask)."""
    half: tl.constexpr = HD // 2
    ok = (heads < n) & (d < HD)  # [BH, HD]
    x = tl.load(ptr + heads * HD + d, mask=ok, other=0.0)
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / HD + eps)  # [BH]
        x = x * inv[:, None] * tl.load(norm_ptr + d)
    if ROPE:
        first = d < half
        pd = tl.where(first, d + half, d - half)
        partner = tl.load(ptr + heads * HD + pd, mask=ok, other=0.0)
        if NORM:
            partner = partner * inv[:, None] * tl.load(norm_ptr + pd)
        c = tl.load(cos_ptr + pos * HD + d)
        s = tl.load(sin_ptr + pos * HD + d)
        x = x * c + tl.where(first, -partner, partner) * s
    return x, ok


@triton.jit
def rope_kv_kernel(qkv_ptr, q_ptr, k_cache, v_cache, cos_ptr, sin_ptr, pos_ptr, qn_ptr, kn_ptr, eps, capacity,
                   H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr,
                   BH: tl.constexpr, BKV: tl.constexpr):
    """q (normed, rotated) -> q_ptr; k (normed, rotated), v -> the caches' row ``pos`` ([KV, capacity, HD] each)."""
    pos = tl.load(pos_ptr)
    d = tl.arange(0, HD)[None, :]  # [1, HD]
    hq = tl.arange(0, BH)[:, None]  # [BH, 1]
    q, qok = _heads(qkv_ptr, hq, H, d, pos, cos_ptr, sin_ptr, qn_ptr, eps, ROPE, QK_NORM, HD)
    tl.store(q_ptr + hq * HD + d, q, mask=qok)
    hk = tl.arange(0, BKV)[:, None]  # [BKV, 1]
    k, kok = _heads(qkv_ptr + H * HD, hk, KV, d, pos, cos_ptr, sin_ptr, kn_ptr, eps, ROPE, QK_NORM, HD)
    v = tl.load(qkv_ptr + H * HD + KV * HD + hk * HD + d, mask=kok, other=0.0)
    slot = hk * capacity * HD + pos * HD + d
    tl.store(k_cache + slot, k.to(k_cache.dtype.element_ty), mask=kok)
    tl.store(v_cache + slot, v.to(v_cache.dtype.element_ty), mask=kok)


@triton.jit
def attention_kernel(q_ptr, k_cache, v_cache, out_ptr, pos_ptr, capacity, scale, window,
                     GROUP: tl.constexpr, HD: tl.constexpr, BN: tl.constexpr):
    """One query head per program over cache rows 0..pos, or the last ``window`` of them (> 0: sliding-window
    layers), with an online softmax."""
    h = tl.program_id(0)
    kv = h // GROUP
    n = tl.load(pos_ptr) + 1
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + h * HD + d) * scale  # [HD]
    m_i = tl.max(tl.full([BN], -1.0e30, tl.float32), 0)
    l_i = tl.sum(tl.zeros([BN], dtype=tl.float32), 0)
    acc = tl.zeros([HD], dtype=tl.float32)
    base = kv * capacity * HD
    s = tl.maximum(n - tl.where(window > 0, window, n), 0)  # the first visible row
    while s < n:
        offs = s + tl.arange(0, BN)  # [BN]
        ok = offs < n
        k = tl.load(k_cache + base + offs[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        scores = tl.where(ok, tl.sum(k * q[None, :], 1), -1.0e30)  # [BN]
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.where(ok, tl.exp(scores - m_new), 0.0)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache + base + offs[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        s += BN
    tl.store(out_ptr + h * HD + d, acc / l_i)


@triton.jit
def embed_kernel(ids_ptr, d1, s1, m1, x_ptr, C, sd1, ss1, embed_scale, FMT: tl.constexpr, BC: tl.constexpr):
    """x = table[token] * embed_scale (the token id read from device memory)."""
    row = tl.load(ids_ptr)
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    ok = cols < C
    w = _load_w(d1, s1, m1, row, cols, ok, sd1, ss1, FMT)
    tl.store(x_ptr + cols, w * embed_scale, mask=ok)


@triton.jit
def add_kernel(x_ptr, y_ptr, C, BC: tl.constexpr):
    """x += y (a CPU part's output arriving on the tier)."""
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    ok = c < C
    tl.store(x_ptr + c, tl.load(x_ptr + c, mask=ok, other=0.0) + tl.load(y_ptr + c, mask=ok, other=0.0), mask=ok)


@triton.jit
def rmsnorm_kernel(x_ptr, norm_ptr, y_ptr, eps, C: tl.constexpr, RESIDUAL: tl.constexpr, BC: tl.constexpr):
    """y = rmsnorm(x) * norm (a CPU part's input), or y += that (RESIDUAL: a sandwich norm's output into the
    residual stream); one program."""
    sq = tl.zeros([BC], dtype=tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        v = tl.load(x_ptr + c, mask=c < C, other=0.0)
        sq += v * v
    inv = 1.0 / tl.sqrt(tl.sum(sq, 0) / C + eps)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        ok = c < C
        y = tl.load(x_ptr + c, mask=ok, other=0.0) * inv * tl.load(norm_ptr + c, mask=ok, other=0.0)
        if RESIDUAL:
            y += tl.load(y_ptr + c, mask=ok, other=0.0)
        tl.store(y_ptr + c, y, mask=ok)
