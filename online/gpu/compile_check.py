"""Compile the GPU step's matvec kernels for a GPU architecture with Triton's own NVIDIA backend, on any machine (no
GPU needed), and report what each variant's PTX loads. Triton's interpreter (the CPU tests) runs kernels as Python and
misses what only the compiler checks: a branch after a constexpr ``if ... return`` is still type-checked, so a tile of
another shape there does not compile.

Run it in a process where ``TRITON_INTERPRET`` is unset (the kernels are decorated at import)::

    python -m online.gpu.compile_check [--arch 90]        # one JSON object per line: variant, ok, loads / error
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys

FMT = {"fp32": 0, "fp16": 1, "q8": 2, "q4": 3, "q4_1": 4}
DATA = {"fp32": "*fp32", "fp16": "*fp16", "q8": "*i8", "q4": "*u8", "q4_1": "*u8"}

# (fmt1, pair's fmt or None, read, rolled, rows per program, columns per tile, columns)
MATVEC_VARIANTS = [("q4", "q4", "words", False, 8, 256, 256), ("q8", None, "words", True, 8, 256, 256),
                   ("q4_1", None, "packed", True, 8, 256, 256), ("q4", "q8", "bytes", False, 8, 128, 256),
                   ("q4", "q4", "words", False, 16, 512, 512)]
DOWN_VARIANTS = [("matvec_t_kernel", "q8"), ("matvec_t_words_kernel", "q8"), ("matvec_t_nibbles_kernel", "q4_1")]


def compile_ptx(fn, pointers: dict, scalars: dict, constexprs: dict, arch: int, warps: int = 4) -> str:
    """The PTX of ``fn`` for sm_<arch>: pointers and scalars typed as given (pointers and integers known to be
    multiples of 16, as Triton's launcher tells the compiler for the tier's tensors and strides), the rest constexpr."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {name: pointers.get(name) or scalars.get(name) or "constexpr" for name in fn.arg_names}
    aligned = [n for n in fn.arg_names if n in pointers or (n in scalars and scalars[n].startswith("i"))]
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}).asm["ptx"]


def matvec_ptx(fmt1: str, fmt2: str | None, read: str, rolled: bool, br: int, bc: int, cols: int, arch: int) -> str:
    from . import kernels
    words = read == "words"
    pointers = dict(x_ptr="*fp32", norm_ptr="*fp32", d1="*i32" if words else DATA[fmt1], s1="*fp16", m1="*fp16",
                    b1="*fp32", d2="*i32" if words else DATA[fmt2 or fmt1], s2="*fp16", m2="*fp16", b2="*fp32",
                    res_ptr="*fp32", y_ptr="*fp32")
    scalars = dict(eps="fp32", R="i32", sd1="i32", ss1="i32", sd2="i32", ss2="i32")
    constexprs = dict(C=cols, NORM=True, PAIR=fmt2 is not None, ACT=1, RESIDUAL=True, HAS_B1=False, HAS_B2=False,
                      FMT1=FMT[fmt1], FMT2=FMT[fmt2 or fmt1], BR=br, BC=bc, ROLLED=rolled, PACKED=read == "packed",
                      WORDS=words)
    return compile_ptx(kernels.matvec_kernel, pointers, scalars, constexprs, arch)


def down_ptx(kernel: str, fmt: str, arch: int) -> str:
    from . import kernels
    words = kernel != "matvec_t_kernel"
    pointers = dict(h_ptr="*fp32", d1="*i32" if words else DATA[fmt], s1="*fp16", m1="*fp16", bias_ptr="*fp32",
                    y_ptr="*fp32")
    scalars = dict(R="i32", C="i32", sw="i32", ss1="i32", sd1="i32")
    constexprs = dict(rows_per_program=128, HAS_BIAS=True, BR=32)
    constexprs.update(dict(BW=32) if words else dict(BC=64))
    if kernel != "matvec_t_words_kernel":
        constexprs["FMT"] = FMT[fmt]
    return compile_ptx(getattr(kernels, kernel), pointers, scalars, constexprs, arch)


def _loads(ptx: str) -> dict:
    return dict(collections.Counter(re.findall(r"ld\.global(?:\.[a-z0-9]+)*", ptx)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    args = p.parse_args(argv)
    jobs = [(f"matvec {v[0]}{'+' + v[1] if v[1] else ''} {v[2]}{' rolled' if v[3] else ''} {v[4]}x{v[5]} C={v[6]}",
             lambda v=v: matvec_ptx(*v, args.arch)) for v in MATVEC_VARIANTS]
    jobs += [(f"{k} {f}", lambda k=k, f=f: down_ptx(k, f, args.arch)) for k, f in DOWN_VARIANTS]
    for name, job in jobs:
        try:
            print(json.dumps({"variant": name, "ok": True, "loads": _loads(job())}), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported per variant: the point is to see which fail
            cause = exc.__cause__ or exc
            print(json.dumps({"variant": name, "ok": False, "error": f"{type(cause).__name__}: {cause}"[:400]}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
