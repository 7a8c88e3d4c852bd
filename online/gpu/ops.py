"""The GPU step's operations on preallocated buffers, in two backends with one signature each:
``triton`` (``kernels``: one launch per op, the tier's formats read as stored) and ``torch`` (the same
math in torch ops: the reference the Triton kernels are tested against, and the path where Triton is
absent). Both keep every input on the device (position and token ids included), so a CUDA graph
captures either.

Example::

    ops = Ops.create(device)                         # "triton" on CUDA when Triton imports, else "torch"
    w = Mat.of(tier_matrix)                          # a TierMatrix as the kernels see it
    ops.matvec(x, w, y, norm=norm_w, eps=1e-5)       # y [R] = W rmsnorm(x)
    ops.matvec_t(h, down_t, x)                       # x [C] += h @ W   (W [R, C] neuron-major)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.core.errors import TandemError

_FORMAT_IDS = {"fp32": 0, "fp16": 1, "q8": 2, "q4": 3, "q4_1": 4}


@dataclass(frozen=True)
class Mat:
    """A ``[rows, cols]`` tier matrix's tensors and strides (elements) as the kernels read them."""
    fmt: str
    rows: int
    cols: int
    data: torch.Tensor
    scale: torch.Tensor | None
    minimum: torch.Tensor | None

    @classmethod
    def of(cls, m) -> "Mat":
        return cls(m.fmt, m.rows, m.cols, m.data, m.scale, m.minimum)

    @property
    def stride_data(self) -> int:
        return int(self.data.shape[1])

    @property
    def stride_scale(self) -> int:
        return int(self.scale.shape[1]) if self.scale is not None else 0

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]`` (the torch backend's weights)."""
        from ..execution.tier_matrix import dequantize_blocks
        return dequantize_blocks(self.fmt, self.rows, self.cols, self.data, self.scale, self.minimum)


def _act(kind: str, y: torch.Tensor) -> torch.Tensor:
    if kind == "none":
        return y
    if kind == "silu":
        return F.silu(y)
    if kind == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if kind == "relu":
        return F.relu(y)
    if kind == "gelu":
        return F.gelu(y)
    raise TandemError(f"the GPU step has no activation {kind!r}")


SUPPORTED_ACTS = ("silu", "gelu_tanh", "relu", "gelu")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class MatvecLaunch:
    """How ``matvec_kernel`` is launched: rows per program, columns per tile, warps, a rolled column loop, and how
    quantized rows are read: byte-wise whole (``packed``, Q4 only) or as 32-bit words (``words``: Q4 or Q8_0,
    both matrices of a pair alike); other formats ignore both."""
    rows_per_program: int
    cols_per_tile: int
    warps: int = 4
    rolled: bool = False
    packed: bool = False
    words: bool = False

    def __post_init__(self) -> None:
        for name in ("rows_per_program", "cols_per_tile", "warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise TandemError(f"MatvecLaunch.{name} must be a power of two, got {value!r}")


@dataclass(frozen=True)
class MatvecTLaunch:
    """How the neuron-major down rows are launched (``matvec_t``): columns per program, rows per unrolled step,
    the most rows a program sums, warps, and Q8_0 / Q4 rows read as 32-bit words (``words``; at least 32 columns
    a program)."""
    cols_per_program: int = 64
    rows_per_step: int = 32
    max_rows_per_program: int = 256
    warps: int = 4
    words: bool = False

    def __post_init__(self) -> None:
        for name in ("cols_per_program", "rows_per_step", "max_rows_per_program", "warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise TandemError(f"MatvecTLaunch.{name} must be a power of two, got {value!r}")


def default_matvec_launch(rows: int, cols: int) -> MatvecLaunch:
    """Rows per program by the matrix's height, 128-column tiles, a byte load per weight: the launches the step was
    measured with on the H100 / H200. Word reads (``words=True``) are tested under Triton's interpreter and not yet
    timed on a GPU (``bash bench/gpu_kernels.sh`` does that)."""
    return MatvecLaunch(4 if rows <= 1024 else (8 if rows <= 8192 else 16), 128 if cols >= 128 else _pow2(cols))


def default_matvec_t_launch(rows: int, cols: int) -> MatvecTLaunch:
    """64 columns per program, 32 rows a step, at most 256 rows a program, a byte load per weight."""
    return MatvecTLaunch()


def matvec_reads(launch: MatvecLaunch, tile_cols: int, w1: Mat, w2: Mat) -> tuple:
    """How the matvec reads ``w1`` and its pair ``w2`` (``w1`` itself when alone) under ``launch`` with tiles of
    ``tile_cols`` columns: ("words" | "packed" | "bytes", data1, data2, row stride1, row stride2), the data as the
    kernel takes it (int32 views for words). Words need both matrices Q4 (Q4_0 / Q4_1) or both Q8_0, rows of whole
    words and tiles of 32 columns or more; packed needs both Q4; anything else is read a byte (or value) at a time."""
    q4 = w1.fmt in ("q4", "q4_1") and w2.fmt in ("q4", "q4_1")
    if launch.words and tile_cols >= 32 and (q4 or w1.fmt == w2.fmt == "q8"):
        v1, v2 = _words_view(w1), _words_view(w2)
        if v1 is not None and v2 is not None:
            return "words", v1, v2, int(v1.shape[1]), int(v2.shape[1])
    read = "packed" if launch.packed and tile_cols >= 32 and q4 else "bytes"
    return read, w1.data, w2.data, w1.stride_data, w2.stride_data


def _words_view(m: Mat) -> torch.Tensor | None:
    """``m``'s codes as int32 words [rows, row bytes / 4], or None where the row bytes do not divide."""
    if m.fmt not in ("q8", "q4", "q4_1") or (m.data.shape[1] * m.data.element_size()) % 4:
        return None
    try:
        return m.data.view(torch.int32)
    except RuntimeError:  # a storage offset not a multiple of 4 bytes
        return None


class Ops:
    """The operations; ``backend`` is "triton" or "torch". ``matvec_launch(rows, cols) -> MatvecLaunch`` and
    ``matvec_t_launch(rows, cols) -> MatvecTLaunch`` replace the default launch shapes (bench/gpu_kernel_rates.py
    and bench/gpu_kernels_ab.py try others)."""

    def __init__(self, backend: str, matvec_launch=None, matvec_t_launch=None) -> None:
        if backend not in ("triton", "torch"):
            raise TandemError(f"unknown GPU-step backend {backend!r}")
        self.backend = backend
        self.matvec_launch = matvec_launch or default_matvec_launch
        self.matvec_t_launch = matvec_t_launch or default_matvec_t_launch
        self.launches = 0  # kernels (or op groups) issued, per step when read as a difference
        if backend == "triton":
            from . import kernels
            self.k = kernels

    @classmethod
    def create(cls, device: torch.device, backend: str | None = None) -> "Ops":
        """Triton on CUDA (or anywhere with TRITON_INTERPRET=1) when it imports; torch ops otherwise."""
        if backend is None:
            backend = "torch"
            if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
                try:
                    import triton  # noqa: F401
                    backend = "triton"
                except ImportError:
                    pass
        return cls(backend)

    # --- y = W x (+ the fusions the step needs) ------------------------------------------------
    def matvec(self, x: torch.Tensor, w1: Mat, y: torch.Tensor, *, norm: torch.Tensor | None = None,
               eps: float = 0.0, w2: Mat | None = None, b1: torch.Tensor | None = None,
               b2: torch.Tensor | None = None, act: str = "none", residual: torch.Tensor | None = None) -> None:
        """y [R] = act(W2 x') * (W1 x' + b1) with W2 (``w2``: a gate), else act(W1 x' + b1); + residual;
        x' = rmsnorm(x) * norm when ``norm`` is given. ``y`` may be ``residual`` (in place)."""
        self.launches += 1
        if self.backend == "torch":
            xn = F.rms_norm(x, x.shape, norm, eps) if norm is not None else x
            out = w1.dequantize() @ xn + (b1 if b1 is not None else 0.0)
            if w2 is not None:
                out = _act(act, w2.dequantize() @ xn + (b2 if b2 is not None else 0.0)) * out
            else:
                out = _act(act, out)
            y.copy_(out + residual if residual is not None else out)
            return
        rows, cols = w1.rows, w1.cols
        launch = self.matvec_launch(rows, cols)
        br, bc = launch.rows_per_program, min(launch.cols_per_tile, _pow2(cols))
        g = w2 if w2 is not None else w1
        read, d1, d2, sd1, sd2 = matvec_reads(launch, bc, w1, g)
        dummy = y
        self.k.matvec_kernel[(triton_cdiv(rows, br),)](
            x, norm if norm is not None else dummy, float(eps),
            d1, _or(w1.scale, dummy), _or(w1.minimum, dummy), _or(b1, dummy),
            d2, _or(g.scale, dummy), _or(g.minimum, dummy), _or(b2, dummy),
            residual if residual is not None else dummy, y, rows, cols,
            sd1, w1.stride_scale, sd2, g.stride_scale,
            NORM=norm is not None, PAIR=w2 is not None, ACT=self.k.ACT_IDS[act], RESIDUAL=residual is not None,
            HAS_B1=b1 is not None, HAS_B2=b2 is not None, FMT1=_FORMAT_IDS[w1.fmt], FMT2=_FORMAT_IDS[g.fmt],
            BR=br, BC=bc, ROLLED=launch.rolled, PACKED=read == "packed", WORDS=read == "words", num_warps=launch.warps)

    def matvec_t(self, h: torch.Tensor, w: Mat, y: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """y [C] += h [R] @ W [R, C] (+ bias): a down projection kept neuron-major, accumulated into ``y``."""
        self.launches += 1
        if self.backend == "torch":
            out = h @ w.dequantize()
            y.add_(out + bias if bias is not None else out)
            return
        rows, cols = w.rows, w.cols
        launch = self.matvec_t_launch(rows, cols)
        view = _words_view(w) if launch.words and launch.cols_per_program >= 32 else None
        bc, br = launch.cols_per_program, launch.rows_per_step
        col_blocks = triton_cdiv(cols, bc)
        steps = max(1, launch.max_rows_per_program // br)  # unrolled steps a program takes at most
        slices = max(1, triton_cdiv(rows, br * steps), min(triton_cdiv(rows, br), 264 // col_blocks))
        rows_per_program = triton_cdiv(triton_cdiv(rows, slices), br) * br
        slices = triton_cdiv(rows, rows_per_program)
        if view is not None:
            grid, sw = (col_blocks, slices), int(view.shape[1])
            if w.fmt == "q8":
                self.k.matvec_t_words_kernel[grid](h, view, w.scale, _or(bias, y), y, rows, cols, sw, w.stride_scale,
                                                   rows_per_program, HAS_BIAS=bias is not None, BR=br, BW=bc // 4,
                                                   num_warps=launch.warps)
            else:
                self.k.matvec_t_nibbles_kernel[grid](h, view, w.scale, _or(w.minimum, y), _or(bias, y), y, rows, cols,
                                                     sw, w.stride_scale, rows_per_program, HAS_BIAS=bias is not None,
                                                     FMT=_FORMAT_IDS[w.fmt], BR=br, BW=bc // 8, num_warps=launch.warps)
            return
        self.k.matvec_t_kernel[(col_blocks, slices)](
            h, w.data, _or(w.scale, y), _or(w.minimum, y), _or(bias, y), y, rows, cols,
            w.stride_data, w.stride_scale, rows_per_program, HAS_BIAS=bias is not None,
            FMT=_FORMAT_IDS[w.fmt], BR=br, BC=bc, num_warps=launch.warps)

    # --- attention -------------------------------------------------------------------------------
    def rope_kv(self, qkv: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cos: torch.Tensor | None, sin: torch.Tensor | None, pos: torch.Tensor, n_heads: int,
                n_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None = None,
                k_norm: torch.Tensor | None = None, eps: float = 0.0) -> None:
        """q (rotated) -> ``q_out`` [H*hd]; k (rotated) and v -> row ``pos`` of the caches [KV, capacity, hd].
        ``q_norm`` / ``k_norm`` [hd]: each head RMS-normed first (Qwen3, Gemma 3)."""
        self.launches += 1
        if self.backend == "torch":
            q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
            q = qkv[:q_dim].reshape(n_heads, head_dim)
            k = qkv[q_dim:q_dim + kv_dim].reshape(n_kv_heads, head_dim)
            v = qkv[q_dim + kv_dim:q_dim + 2 * kv_dim].reshape(n_kv_heads, head_dim)
            if q_norm is not None:
                q, k = F.rms_norm(q, (head_dim,), q_norm, eps), F.rms_norm(k, (head_dim,), k_norm, eps)
            if cos is not None:
                c, s = cos.index_select(0, pos), sin.index_select(0, pos)  # [1, hd]
                half = head_dim // 2
                q = q * c + torch.cat([-q[:, half:], q[:, :half]], dim=-1) * s
                k = k * c + torch.cat([-k[:, half:], k[:, :half]], dim=-1) * s
            q_out.copy_(q.reshape(-1))
            k_cache.index_copy_(1, pos, k[:, None, :].to(k_cache.dtype))
            v_cache.index_copy_(1, pos, v[:, None, :].to(v_cache.dtype))
            return
        self.k.rope_kv_kernel[(1,)](qkv, q_out, k_cache, v_cache, cos if cos is not None else qkv,
                                    sin if sin is not None else qkv, pos, _or(q_norm, qkv), _or(k_norm, qkv),
                                    float(eps), k_cache.shape[1], H=n_heads, KV=n_kv_heads, HD=head_dim,
                                    ROPE=cos is not None, QK_NORM=q_norm is not None, BH=max(2, _pow2(n_heads)),
                                    BKV=max(2, _pow2(n_kv_heads)))  # (a 1-wide arange: avoided)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  pos: torch.Tensor, scale: float, n_heads: int, n_kv_heads: int, head_dim: int,
                  window: int = 0) -> None:
        """out [H*hd]: each head's softmax(q k^T * scale) v over cache rows 0..pos, or only the last ``window``
        of them (sliding-window layers; 0: all)."""
        self.launches += 1
        if self.backend == "torch":
            capacity = k_cache.shape[1]
            group = n_heads // n_kv_heads
            keys = k_cache.float().repeat_interleave(group, dim=0)  # [H, cap, hd]
            values = v_cache.float().repeat_interleave(group, dim=0)
            scores = torch.einsum("hd,hcd->hc", q.reshape(n_heads, head_dim), keys) * scale  # [H, cap]
            rows = torch.arange(capacity, device=q.device)
            visible = (rows <= pos) & ((pos - rows < window) if window > 0 else True)  # [cap]
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out.copy_(torch.einsum("hc,hcd->hd", probs, values).reshape(-1))
            return
        self.k.attention_kernel[(n_heads,)](q, k_cache, v_cache, out, pos, k_cache.shape[1], float(scale),
                                            int(window), GROUP=n_heads // n_kv_heads, HD=head_dim, BN=32)

    # --- small ops -------------------------------------------------------------------------------
    def embed(self, token: torch.Tensor, table: Mat, x: torch.Tensor, embed_scale: float = 1.0) -> None:
        """x [d] = table[token] * embed_scale (``token``: a 1-element int64 tensor on the device)."""
        self.launches += 1
        if self.backend == "torch":
            sub = Mat(table.fmt, 1, table.cols, table.data.index_select(0, token),
                      None if table.scale is None else table.scale.index_select(0, token),
                      None if table.minimum is None else table.minimum.index_select(0, token))
            x.copy_(sub.dequantize()[0] * embed_scale)
            return
        bc = 256
        self.k.embed_kernel[(triton_cdiv(table.cols, bc),)](
            token, table.data, _or(table.scale, x), _or(table.minimum, x), x, table.cols,
            table.stride_data, table.stride_scale, float(embed_scale), FMT=_FORMAT_IDS[table.fmt], BC=bc)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x += y."""
        self.launches += 1
        if self.backend == "torch":
            x.add_(y)
            return
        self.k.add_kernel[(triton_cdiv(x.numel(), 1024),)](x, y, x.numel(), BC=1024)

    def rmsnorm(self, x: torch.Tensor, norm: torch.Tensor, y: torch.Tensor, eps: float, add: bool = False) -> None:
        """y = rmsnorm(x) * norm; with ``add``, y += that (a sandwich norm's output into the residual stream)."""
        self.launches += 1
        if self.backend == "torch":
            out = F.rms_norm(x, x.shape, norm, eps)
            y.copy_(y + out if add else out)
            return
        self.k.rmsnorm_kernel[(1,)](x, norm, y, float(eps), x.numel(), RESIDUAL=add, BC=1024)

    def zero(self, x: torch.Tensor) -> None:
        """x = 0 (an accumulator the hot rows add into)."""
        self.launches += 1
        x.zero_()


def _or(t: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    return t if t is not None else fallback


def triton_cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))
