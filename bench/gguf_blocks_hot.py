"""f16-scale GGUF blocks read in place (KIND_I4H / KIND_I8H, native/blocks_dot.h) against their float32-scale
twins, one thread, hot cache (the weights fit L2/L3: SmolLM2's narrow matrices, where widening the scales
cost the most): ``tdm_dot_rows`` over every row, the two formats interleaved call by call, min and median of
the calls. Asserts the outputs are bit-identical.

    python -m bench.gguf_blocks_hot --shapes 1536x576 576x1536 4096x2048 --repeats 300
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["1536x576", "576x1536", "4096x2048"])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    import gguf
    from bench.gguf_blocks_ab import float_scale_twin
    from online.kernels.native import load_native
    from online.kernels.native.structs import describe
    from online.kernels.quantize import weight_from_gguf

    lib = load_native().lib
    rng = np.random.default_rng(0)
    print("| shape | GGUF type | f16 in place us (min / median) | f32 twin us (min / median) | twin / in place (mins) |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        R, C = (int(v) for v in shape.split("x"))
        w = (rng.standard_normal((R, C)) * 0.02).astype(np.float32)
        x = rng.standard_normal(C).astype(np.float32)
        x[37] = 30.0  # an outlier block: the residual pass runs too
        for qt in ("Q4_0", "Q4_1", "Q8_0"):
            qtype = getattr(gguf.GGMLQuantizationType, qt)
            a = weight_from_gguf(gguf.quants.quantize(w, qtype), qtype, (R, C))
            da, db = describe(a), describe(float_scale_twin(a))
            oa, ob = np.zeros(R, np.float32), np.zeros(R, np.float32)
            ta: list[float] = []
            tb: list[float] = []
            for _ in range(args.repeats):
                for d, o, t in ((da, oa, ta), (db, ob, tb)):
                    t0 = time.perf_counter_ns()
                    lib.tdm_dot_rows(ctypes.byref(d.desc), 0, R, x.ctypes.data, 3.0, o.ctypes.data)
                    t.append((time.perf_counter_ns() - t0) / 1e3)
            assert np.array_equal(oa, ob), qt
            print(f"| {R}x{C} | {qt} | {min(ta):.1f} / {statistics.median(ta):.1f} | {min(tb):.1f} / "
                  f"{statistics.median(tb):.1f} | {min(tb) / min(ta):.3f} |", flush=True)


if __name__ == "__main__":
    main()
