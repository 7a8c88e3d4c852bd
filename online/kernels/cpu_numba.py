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

The IR lives in this file on purpose: numba's on-disk cache only checks this file's timestamp.

Example::

    th = clamp_threads(2)
    y = np.empty((1, 1536), np.float32)
    gemv_rows(quantize_int8(w).kernel_args(), np.arange(1536), x, y, th)   # x float32 [1, 576]
    count = ffn_fused(g.kernel_args(), u.kernel_args(), dT.kernel_args(), x, ACT_IDS["silu"], 0.0,
                      0.05, True, EMPTY_F32, EMPTY_F32, np.arange(1536), y, th)
"""
from __future__ import annotations

import math
import os

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .quantize import ACT_IDS, F16_VECTOR, KIND_F16, KIND_F32, KIND_I4, KIND_I8, KIND_I8B
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
# LLVM IR for the blocked formats (vector width = half a group for int4, a whole block for int8)

def _vec(n: int, ty: str, value: str) -> str:
    return "<" + ", ".join(f"{ty} {value}" for _ in range(n)) + ">"


def _splat(n: int, name: str, scalar: str) -> str:
    return (f"  %{name}.i = insertelement <{n} x float> poison, float {scalar}, i64 0\n"
            f"  %{name} = shufflevector <{n} x float> %{name}.i, <{n} x float> poison, <{n} x i32> zeroinitializer\n")


def _nibbles(h: int) -> str:
    """%lof / %hif <h x float> from the h packed bytes at %pp."""
    return (f"  %b = load <{h} x i8>, ptr %pp, align 1\n"
            f"  %lo = and <{h} x i8> %b, {_vec(h, 'i8', '15')}\n"
            f"  %hi = lshr <{h} x i8> %b, {_vec(h, 'i8', '4')}\n"
            f"  %lof = uitofp <{h} x i8> %lo to <{h} x float>\n"
            f"  %hif = uitofp <{h} x i8> %hi to <{h} x float>\n")


def _loop(body: str, phis: str, n: str) -> str:
    return ("entry:\n"
            f"  %empty = icmp eq i64 {n}, 0\n"
            "  br i1 %empty, label %done, label %loop\n"
            "loop:\n"
            "  %g = phi i64 [0, %entry], [%gn, %loop]\n"
            f"{phis}{body}"
            "  %gn = add nuw nsw i64 %g, 1\n"
            f"  %more = icmp ult i64 %gn, {n}\n"
            "  br i1 %more, label %loop, label %exit\n")


def _ir_q4(group: int) -> str:
    h = group // 2
    v = f"<{h} x float>"
    fma = f"@llvm.fma.v{h}f32"
    dot_body = (f"  %po = mul nuw nsw i64 %g, {h}\n  %pp = getelementptr inbounds i8, ptr %p, i64 %po\n"
                + _nibbles(h)
                + f"  %xo = mul nuw nsw i64 %g, {group}\n  %xp = getelementptr inbounds float, ptr %x, i64 %xo\n"
                f"  %xl = load {v}, ptr %xp, align 4\n  %xhp = getelementptr inbounds float, ptr %xp, i64 {h}\n"
                f"  %xh = load {v}, ptr %xhp, align 4\n"
                f"  %t = fmul fast {v} %lof, %xl\n"
                f"  %t2 = call fast {v} {fma}({v} %hif, {v} %xh, {v} %t)\n"
                "  %dp = getelementptr inbounds float, ptr %d, i64 %g\n  %dg = load float, ptr %dp, align 4\n"
                + _splat(h, "ds", "%dg")
                + f"  %accn = call fast {v} {fma}({v} %t2, {v} %ds, {v} %acc)\n"
                "  %mp = getelementptr inbounds float, ptr %m, i64 %g\n  %mg = load float, ptr %mp, align 4\n"
                "  %sp = getelementptr inbounds float, ptr %xs, i64 %g\n  %sg = load float, ptr %sp, align 4\n"
                "  %amn = call fast float @llvm.fma.f32(float %mg, float %sg, float %am)\n")
    dot_phis = (f"  %acc = phi {v} [zeroinitializer, %entry], [%accn, %loop]\n"
                "  %am = phi float [0.0, %entry], [%amn, %loop]\n")
    axpy_body = (f"  %po = mul nuw nsw i64 %g, {h}\n  %pp = getelementptr inbounds i8, ptr %p, i64 %po\n"
                 + _nibbles(h)
                 + "  %dp = getelementptr inbounds float, ptr %d, i64 %g\n  %dg = load float, ptr %dp, align 4\n"
                 "  %mp = getelementptr inbounds float, ptr %m, i64 %g\n  %mg = load float, ptr %mp, align 4\n"
                 "  %hd = fmul fast float %h, %dg\n  %hm = fmul fast float %h, %mg\n"
                 + _splat(h, "hds", "%hd") + _splat(h, "hms", "%hm")
                 + f"  %yo = mul nuw nsw i64 %g, {group}\n  %yp = getelementptr inbounds float, ptr %y, i64 %yo\n"
                 f"  %yhp = getelementptr inbounds float, ptr %yp, i64 {h}\n"
                 f"  %yl = load {v}, ptr %yp, align 4\n  %yh = load {v}, ptr %yhp, align 4\n"
                 f"  %yl1 = fadd fast {v} %yl, %hms\n  %yh1 = fadd fast {v} %yh, %hms\n"
                 f"  %yl2 = call fast {v} {fma}({v} %lof, {v} %hds, {v} %yl1)\n"
                 f"  %yh2 = call fast {v} {fma}({v} %hif, {v} %hds, {v} %yh1)\n"
                 f"  store {v} %yl2, ptr %yp, align 4\n  store {v} %yh2, ptr %yhp, align 4\n")
    deq_body = (f"  %po = mul nuw nsw i64 %g, {h}\n  %pp = getelementptr inbounds i8, ptr %p, i64 %po\n"
                + _nibbles(h)
                + "  %dp = getelementptr inbounds float, ptr %d, i64 %g\n  %dg = load float, ptr %dp, align 4\n"
                "  %mp = getelementptr inbounds float, ptr %m, i64 %g\n  %mg = load float, ptr %mp, align 4\n"
                + _splat(h, "ds", "%dg") + _splat(h, "ms", "%mg")
                + f"  %oo = mul nuw nsw i64 %g, {group}\n  %op = getelementptr inbounds float, ptr %o, i64 %oo\n"
                f"  %ohp = getelementptr inbounds float, ptr %op, i64 {h}\n"
                f"  %ol = call fast {v} {fma}({v} %lof, {v} %ds, {v} %ms)\n"
                f"  %oh = call fast {v} {fma}({v} %hif, {v} %ds, {v} %ms)\n"
                f"  store {v} %ol, ptr %op, align 4\n  store {v} %oh, ptr %ohp, align 4\n")
    return (f"declare {v} {fma}({v}, {v}, {v})\n"
            f"declare float @llvm.vector.reduce.fadd.v{h}f32(float, {v})\n"
            f"define void @tdm_deq_q4g{group}(ptr %o, ptr %p, ptr %d, ptr %m, i64 %n) alwaysinline {{\n"
            + _loop(deq_body, "", "%n") + "exit:\n  ret void\ndone:\n  ret void\n}\n"
            f"define float @tdm_dot_q4g{group}(ptr %p, ptr %d, ptr %m, ptr %x, ptr %xs, i64 %n) alwaysinline {{\n"
            + _loop(dot_body, dot_phis, "%n")
            + f"exit:\n  %r = call fast float @llvm.vector.reduce.fadd.v{h}f32(float 0.0, {v} %accn)\n"
            "  %r2 = fadd fast float %r, %amn\n  ret float %r2\ndone:\n  ret float 0.0\n}\n"
            f"define void @tdm_axpy_q4g{group}(ptr %y, ptr %p, ptr %d, ptr %m, float %h, i64 %n) alwaysinline {{\n"
            + _loop(axpy_body, "", "%n") + "exit:\n  ret void\ndone:\n  ret void\n}\n")


def _ir_i8b() -> str:
    v = "<32 x float>"
    fma = "@llvm.fma.v32f32"
    load = ("  %o = mul nuw nsw i64 %g, 32\n  %wp = getelementptr inbounds i8, ptr %w, i64 %o\n"
            "  %b = load <32 x i8>, ptr %wp, align 1\n  %bf = sitofp <32 x i8> %b to <32 x float>\n"
            "  %sp = getelementptr inbounds float, ptr %s, i64 %g\n  %sg = load float, ptr %sp, align 4\n")
    dot_body = (load + "  %xp = getelementptr inbounds float, ptr %x, i64 %o\n"
                f"  %xv = load {v}, ptr %xp, align 4\n  %t = fmul fast {v} %bf, %xv\n"
                + _splat(32, "ss", "%sg")
                + f"  %accn = call fast {v} {fma}({v} %t, {v} %ss, {v} %acc)\n")
    axpy_body = (load + "  %hs = fmul fast float %h, %sg\n" + _splat(32, "hss", "%hs")
                 + "  %yp = getelementptr inbounds float, ptr %y, i64 %o\n"
                 f"  %yv = load {v}, ptr %yp, align 4\n"
                 f"  %yn = call fast {v} {fma}({v} %bf, {v} %hss, {v} %yv)\n  store {v} %yn, ptr %yp, align 4\n")
    deq_body = (load + _splat(32, "ss", "%sg") + "  %op = getelementptr inbounds float, ptr %o, i64 %o\n"
                f"  %ov = fmul fast {v} %bf, %ss\n  store {v} %ov, ptr %op, align 4\n")
    return (f"declare {v} {fma}({v}, {v}, {v})\n"
            f"declare float @llvm.vector.reduce.fadd.v32f32(float, {v})\n"
            "define void @tdm_deq_i8b32(ptr %out, ptr %w, ptr %s, i64 %n) alwaysinline {\n"
            + _loop(deq_body.replace("ptr %o, i64 %o", "ptr %out, i64 %o"), "", "%n") + "exit:\n  ret void\ndone:\n  ret void\n}\n"
            "define float @tdm_dot_i8b32(ptr %w, ptr %s, ptr %x, i64 %n) alwaysinline {\n"
            + _loop(dot_body, f"  %acc = phi {v} [zeroinitializer, %entry], [%accn, %loop]\n", "%n")
            + f"exit:\n  %r = call fast float @llvm.vector.reduce.fadd.v32f32(float 0.0, {v} %accn)\n"
            "  ret float %r\ndone:\n  ret float 0.0\n}\n"
            "define void @tdm_axpy_i8b32(ptr %y, ptr %w, ptr %s, float %h, i64 %n) alwaysinline {\n"
            + _loop(axpy_body, "", "%n") + "exit:\n  ret void\ndone:\n  ret void\n}\n")


def _ir_f16() -> str:
    """float16 rows (numba has no CPU float16): 8 halves at a time, widened with fpext (F16C)."""
    v, fma = "<8 x float>", "@llvm.fma.v8f32"
    load = ("  %o = mul nuw nsw i64 %g, 8\n  %wp = getelementptr inbounds half, ptr %w, i64 %o\n"
            "  %wh = load <8 x half>, ptr %wp, align 2\n  %wf = fpext <8 x half> %wh to <8 x float>\n")
    dot_body = (load + "  %xp = getelementptr inbounds float, ptr %x, i64 %o\n"
                f"  %xv = load {v}, ptr %xp, align 4\n  %accn = call fast {v} {fma}({v} %wf, {v} %xv, {v} %acc)\n")
    axpy_body = (load + _splat(8, "hs", "%h") + "  %yp = getelementptr inbounds float, ptr %y, i64 %o\n"
                 f"  %yv = load {v}, ptr %yp, align 4\n  %yn = call fast {v} {fma}({v} %wf, {v} %hs, {v} %yv)\n"
                 f"  store {v} %yn, ptr %yp, align 4\n")
    deq_body = load + "  %op = getelementptr inbounds float, ptr %out, i64 %o\n" f"  store {v} %wf, ptr %op, align 4\n"
    return (f"declare {v} {fma}({v}, {v}, {v})\n"
            f"declare float @llvm.vector.reduce.fadd.v8f32(float, {v})\n"
            "define float @tdm_dot_f16(ptr %w, ptr %x, i64 %n) alwaysinline {\n"
            + _loop(dot_body, f"  %acc = phi {v} [zeroinitializer, %entry], [%accn, %loop]\n", "%n")
            + f"exit:\n  %r = call fast float @llvm.vector.reduce.fadd.v8f32(float 0.0, {v} %accn)\n"
            "  ret float %r\ndone:\n  ret float 0.0\n}\n"
            "define void @tdm_axpy_f16(ptr %y, ptr %w, float %h, i64 %n) alwaysinline {\n"
            + _loop(axpy_body, "", "%n") + "exit:\n  ret void\ndone:\n  ret void\n}\n"
            "define void @tdm_deq_f16(ptr %out, ptr %w, i64 %n) alwaysinline {\n"
            + _loop(deq_body, "", "%n") + "exit:\n  ret void\ndone:\n  ret void\n}\n")


def _ir_module() -> str:
    text = "declare float @llvm.fma.f32(float, float, float)\n" + _ir_q4(32) + _ir_i8b() + _ir_f16()
    q64 = _ir_q4(64).replace("declare <32 x float> @llvm.fma.v32f32(<32 x float>, <32 x float>, <32 x float>)\n", "")
    return text + q64.replace("declare float @llvm.vector.reduce.fadd.v32f32(float, <32 x float>)\n", "")


def _ir_library(context):
    lib = context.codegen().create_library("tandem_kernels_ir")
    mod = llvm.parse_assembly(_ir_module())
    mod.verify()
    lib.add_llvm_module(mod)
    return lib


def _ir_codegen(fn_name: str, returns_float: bool, n_ptrs: int):
    def codegen(context, builder, signature, values):
        context.add_linking_libs([_ir_library(context)])
        ll_args, ll_types = [], []
        for pos, (ty, val) in enumerate(zip(signature.args, values)):
            if pos < n_ptrs:  # an address (uint64) -> ptr
                ll_args.append(builder.inttoptr(context.cast(builder, val, ty, types.uint64), ir.PointerType()))
                ll_types.append(ir.PointerType())
            elif isinstance(ty, types.Float):
                ll_args.append(context.cast(builder, val, ty, types.float32))
                ll_types.append(ir.FloatType())
            else:
                ll_args.append(context.cast(builder, val, ty, types.int64))
                ll_types.append(ir.IntType(64))
        fnty = ir.FunctionType(ir.FloatType() if returns_float else ir.VoidType(), ll_types)
        fn = builder.module.globals.get(fn_name) or ir.Function(builder.module, fnty, fn_name)
        result = builder.call(fn, ll_args)
        return result if returns_float else context.get_dummy_value()
    return codegen


def _ir_call(fn_name: str, returns_float: bool, n_ptrs: int, n_scalars: int):
    """An intrinsic calling IR function ``fn_name`` with ``n_ptrs`` addresses (uint64, from
    ``_addr``) then ``n_scalars`` int64/float32 values. Raw addresses keep numba from
    reference-counting array views inside the hot loops (an atomic per row otherwise)."""
    ret = types.float32 if returns_float else types.void
    codegen = _ir_codegen(fn_name, returns_float, n_ptrs)
    arity = n_ptrs + n_scalars
    if arity == 3:
        def typer(typingctx, a0, a1, a2):
            return ret(a0, a1, a2), codegen
    elif arity == 4:
        def typer(typingctx, a0, a1, a2, a3):
            return ret(a0, a1, a2, a3), codegen
    elif arity == 5:
        def typer(typingctx, a0, a1, a2, a3, a4):
            return ret(a0, a1, a2, a3, a4), codegen
    elif arity == 6:
        def typer(typingctx, a0, a1, a2, a3, a4, a5):
            return ret(a0, a1, a2, a3, a4, a5), codegen
    else:
        def typer(typingctx, a0, a1, a2, a3, a4, a5, a6):
            return ret(a0, a1, a2, a3, a4, a5, a6), codegen
    typer.__name__ = fn_name
    return intrinsic(typer)


_dot_q4g32 = _ir_call("tdm_dot_q4g32", True, 5, 1)  # (packed, scale, minimum, x, xsum; ngroups)
_dot_q4g64 = _ir_call("tdm_dot_q4g64", True, 5, 1)
_axpy_q4g32 = _ir_call("tdm_axpy_q4g32", False, 4, 2)  # (y, packed, scale, minimum; h, ngroups)
_axpy_q4g64 = _ir_call("tdm_axpy_q4g64", False, 4, 2)
_dot_i8b32 = _ir_call("tdm_dot_i8b32", True, 3, 1)  # (q, scale, x; nblocks)
_deq_q4g32 = _ir_call("tdm_deq_q4g32", False, 4, 1)  # (out, packed, scale, minimum; ngroups)
_deq_q4g64 = _ir_call("tdm_deq_q4g64", False, 4, 1)
_deq_i8b32 = _ir_call("tdm_deq_i8b32", False, 3, 1)  # (out, q, scale; nblocks)
_axpy_i8b32 = _ir_call("tdm_axpy_i8b32", False, 3, 2)  # (y, q, scale; h, nblocks)
_dot_f16 = _ir_call("tdm_dot_f16", True, 2, 1)  # (w, x; n / 8)
_axpy_f16 = _ir_call("tdm_axpy_f16", False, 2, 2)  # (y, w; h, n / 8)
_deq_f16 = _ir_call("tdm_deq_f16", False, 2, 1)  # (out, w; n / 8)


@intrinsic
def _set_num_threads(typingctx, n):
    """numba.set_num_threads inside a kernel without the ctypes global that blocks disk caching:
    a direct call of the threading layer's ``set_num_threads`` symbol (no range check: callers
    pass ``clamp_threads`` values)."""
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
        fn = builder.module.globals.get("set_num_threads") or ir.Function(builder.module, fnty, "set_num_threads")
        builder.call(fn, [builder.trunc(context.cast(builder, args[0], signature.args[0], types.int64), ir.IntType(32))])
        return context.get_dummy_value()
    return types.void(n), codegen


if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
    # OpenMP first: a parallel region costs ~3 us there against ~45 us with workqueue (no-op if numba
    # already started its pool)
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
numba.get_num_threads()  # starts the thread pool, which registers the symbol above


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


def clamp_threads(threads: int) -> int:
    """A thread count numba can run: 1 .. its pool size (NUMBA_NUM_THREADS, default: CPU count)."""
    return max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))


def set_threads(threads: int) -> int:
    """Make ``threads`` the calling thread's numba thread count (the kernels also set it); returns it."""
    threads = clamp_threads(threads)
    numba.set_num_threads(threads)
    return threads
