"""The module path's row kernels: numba (online/kernels/cpu_numba.py, retired by issue 14.4) against the C
kernels (native/module.h: online/kernels/cpu_kernels.py), interleaved call by call in one process, same
weights and inputs, hot cache. numba's kernels are gone from the tree; to rerun, restore them beside the C
ones (and have numba installed):

    git show 544d6c1:online/kernels/cpu_numba.py > online/kernels/cpu_numba.py
    git show 544d6c1:online/kernels/numba_ir.py > online/kernels/numba_ir.py
    python -m bench.module_kernels_ab --repeats 60 --threads 1
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time

import numpy as np


def numba_args(w) -> tuple:
    """The tuple numba's kernels took (the former ``Weight.kernel_args()``): kind, bytes, float32 scales, group."""
    q = importlib.import_module("online.kernels.quantize")  # the package exports a function of that name
    dummy = np.zeros((1, 1), np.float32)
    if isinstance(w, (q.Fp32Weight, q.Fp16Weight)):
        return (w.KIND, w.w.view(np.uint8), dummy, dummy, 1)
    if isinstance(w, q.Int8Weight):
        return (q.KIND_I8, w.q.view(np.uint8), w.scale.reshape(-1, 1), dummy, 1)
    if isinstance(w, q.BlockInt8Weight):
        return (q.KIND_I8B, w.q.view(np.uint8), w.scale.astype(np.float32), dummy, q.Q8_BLOCK)
    scale, minimum = w.float_scales()
    return (q.KIND_I4, w.packed, scale, minimum, w.group_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from online.kernels import cpu_kernels as C
    try:
        from online.kernels import cpu_numba as N
    except ImportError:
        raise SystemExit("bench.module_kernels_ab needs numba's kernels: restore them from commit 544d6c1 (see --help)")
    from online.kernels.quantize import ACT_IDS, quantize

    rng = np.random.default_rng(0)
    th = C.clamp_threads(args.threads)
    print("| kernel | shape | format | T | numba us (median / min) | C us (median / min) | numba / C (medians) |")
    print("|---|---|---|---|---|---|---|")
    for rows, cols in ((1536, 576), (4096, 2048)):
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        dt = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        for fmt in ("int8", "int8b", "int4", "fp16"):
            wq = quantize(w, fmt)
            down = quantize(dt, "fp16" if fmt == "fp16" else fmt)
            ka, kr = numba_args(wq), C.kernel_weight(wq)
            da, dr = numba_args(down), C.kernel_weight(down)
            all_rows = np.arange(rows, dtype=np.int64)
            for T in (1, 3, 6):
                x = rng.standard_normal((T, cols)).astype(np.float32)
                y1, y2 = np.empty((T, rows), np.float32), np.empty((T, rows), np.float32)
                f1, f2 = np.empty((T, cols), np.float32), np.empty((T, cols), np.float32)
                cases = {
                    "gemv": (lambda: N.gemv_rows(ka, all_rows, x, y1, th),
                             lambda: C.gemv_rows(kr, None, x, y2, th), (y1, y2)),
                    "ffn (gated, silu, threshold 0.05)": (
                        lambda: N.ffn_fused(ka, ka, da, x, ACT_IDS["silu"], 0.0, 0.05, True, N.EMPTY_F32, N.EMPTY_F32,
                                            all_rows, f1, th),
                        lambda: C.ffn_fused(kr, kr, dr, x, ACT_IDS["silu"], 0.0, 0.05, None, None, None, f2, th),
                        (f1, f2)),
                }
                for name, (a, b, outs) in cases.items():
                    ta, tb = [], []
                    a(), b()
                    for _ in range(args.repeats):
                        for fn, t in ((a, ta), (b, tb)):
                            t0 = time.perf_counter_ns()
                            fn()
                            t.append((time.perf_counter_ns() - t0) / 1e3)
                    err = float(np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max())
                    assert err < 1e-4, (name, fmt, T, err)
                    ma, mb = statistics.median(ta), statistics.median(tb)
                    print(f"| {name} | {rows}x{cols} | {fmt} | {T} | {ma:.0f} / {min(ta):.0f} | {mb:.0f} / {min(tb):.0f} "
                          f"| {ma / mb:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
