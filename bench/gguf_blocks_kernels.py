"""Row kernels per weight format, one thread: the f16-scale / Q4_K formats read in place (native/blocks.h)
against the float32-scale formats, and the sparse down rows as fp16 / Q8_0 / Q4_1 rows.

Contention-robust: the formats are timed interleaved, call by call, and each reports the minimum time
of its calls (a call that kept its core) and bytes read; ns per weight and GB/s follow. Every format has
its own arrays, and a 96 MB buffer is read between calls, so no call finds another's weights in cache.

    python -m bench.gguf_blocks_kernels --rows 4096 --cols 2048 --repeats 40
"""
from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--active", type=float, default=0.25, help="share of down rows read by the axpys")
    args = ap.parse_args()
    import gguf
    from bench.gguf_blocks_ab import float_scale_twin
    from online.kernels.native import load_native
    from online.kernels.native.structs import describe
    from online.kernels.quantize import quantize, weight_from_gguf

    lib = load_native().lib
    flush = np.ones(96 << 18, np.float32)  # 96 MB: more than the last-level cache
    rng = np.random.default_rng(0)
    R, C = args.rows, args.cols
    w = (rng.standard_normal((R, C)) * 0.02).astype(np.float32)
    dots = {}
    for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K"):
        if qtype == "Q4_K":  # gguf has no Q4_K quantizer: random blocks with small f16 d, dmin
            raw = rng.integers(0, 256, size=(R * C // 256, 144), dtype=np.uint8)
            raw[:, 0:4] = np.full((raw.shape[0], 2), 1e-3, np.float16).view(np.uint8)
        else:
            raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))
        packed = weight_from_gguf(raw, qtype, (R, C))
        dots[f"{qtype} in place"] = packed
        twin = float_scale_twin(packed)  # its own copies of the codes (no shared cache lines)
        dots[f"{qtype} as float32 scales"] = type(twin)(**{f: (getattr(twin, f).copy() if isinstance(getattr(twin, f), np.ndarray)
                                                             else getattr(twin, f)) for f in twin.__dataclass_fields__})
    x = rng.standard_normal(C).astype(np.float32)
    out = np.zeros(R, np.float32)
    refs = {k: describe(v) for k, v in dots.items()}
    best = dict.fromkeys(dots, float("inf"))
    for _ in range(args.repeats):
        for k, ref in refs.items():
            flush.sum()
            t0 = time.perf_counter()
            lib.tdm_dot_rows(ctypes.byref(ref.desc), 0, R, x.ctypes.data, -1.0, out.ctypes.data)
            best[k] = min(best[k], time.perf_counter() - t0)
    print(f"Row dots, W [{R}, {C}] . x (one thread, tdm_dot_rows, min of {args.repeats} interleaved calls)\n")
    print("| format | bytes/weight | us / call | ns / weight | GB/s |\n|---|---|---|---|---|")
    for k, v in dots.items():
        print(f"| {k} | {v.nbytes / (R * C):.4f} | {best[k] * 1e6:.0f} | {best[k] * 1e9 / (R * C):.3f} | {v.nbytes / best[k] / 1e9:.1f} |")
    down = {"fp16": quantize(w, "fp16"), "q8 (int8b)": quantize(w, "int8b"), "q4_1 (int4)": quantize(w, "int4")}
    n = int(args.active * R)
    idx = np.sort(rng.choice(R, n, replace=False)).astype(np.int32)
    h = rng.standard_normal(n).astype(np.float32)
    y = np.zeros(C, np.float32)
    refs = {k: describe(v, dot_input=False) for k, v in down.items()}
    best = dict.fromkeys(down, float("inf"))
    for _ in range(args.repeats):
        for k, ref in refs.items():
            flush.sum()
            t0 = time.perf_counter()
            lib.tdm_axpy_rows(ctypes.byref(ref.desc), idx.ctypes.data, h.ctypes.data, n, y.ctypes.data)
            best[k] = min(best[k], time.perf_counter() - t0)
    print(f"\nSparse down rows: y [{C}] += h . W[idx] for {n} of {R} rows (one thread, axpy_rows, min of {args.repeats})\n")
    print("| down rows | bytes/weight | us / call | ns / weight | GB/s |\n|---|---|---|---|---|")
    for k, v in down.items():
        per = v.nbytes / (R * C)
        print(f"| {k} | {per:.4f} | {best[k] * 1e6:.0f} | {best[k] * 1e9 / (n * C):.3f} | {per * n * C / best[k] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
