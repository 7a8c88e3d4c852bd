"""The LLVM IR side of the numba kernels: vector-typed row dot / axpy / dequantize functions for the
blocked formats (int4 groups, Q8_0 blocks, fp16), the ``intrinsic`` handles that call them from numba
code, the in-kernel thread-count setter, and the threading-layer choice.

numba's on-disk cache keys cpu_numba's kernels on cpu_numba.py alone, and they inline this module's IR:
cpu_numba pins this file's digest (IR_DIGEST) and refuses to import when it changed, so an edit here
always comes with an edit there (and a fresh cache).

Example::

    th = clamp_threads(2)                      # 1 .. NUMBA_NUM_THREADS
    text = ir_module()                         # the IR linked into every kernel
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

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


def ir_module() -> str:
    text = "declare float @llvm.fma.f32(float, float, float)\n" + _ir_q4(32) + _ir_i8b() + _ir_f16()
    q64 = _ir_q4(64).replace("declare <32 x float> @llvm.fma.v32f32(<32 x float>, <32 x float>, <32 x float>)\n", "")
    return text + q64.replace("declare float @llvm.vector.reduce.fadd.v32f32(float, <32 x float>)\n", "")


def _ir_library(context):
    lib = context.codegen().create_library("tandem_kernels_ir")
    mod = llvm.parse_assembly(ir_module())
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



def clamp_threads(threads: int) -> int:
    """A thread count numba can run: 1 .. its pool size (NUMBA_NUM_THREADS, default: CPU count)."""
    return max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))


def set_threads(threads: int) -> int:
    """Make ``threads`` the calling thread's numba thread count (the kernels also set it); returns it."""
    threads = clamp_threads(threads)
    numba.set_num_threads(threads)
    return threads
