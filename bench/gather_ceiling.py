"""What this host's memory gives gathered rows, with no kernel in the way: the ceiling under the sparse step.

A pure read (AVX2 loads summed, OpenMP threads splitting the rows as the step splits a pass) of a share of
the rows of a matrix past the last-level cache, picked at random and sorted, against the same read of every
row. Each pass runs after an eviction buffer is read. Two layouts of a neuron's bytes are timed side by
side: its gate/up pair (``--pair-bytes``, one contiguous read, as the step's pair copy) and its fp16 down
row (``--down-bytes``) in two matrices, or all three bundled in one record. Software prefetch runs
``--ahead`` rows ahead (0: none). The fused step's gathered kernels can be no faster than these rates.

    python -m bench.gather_ceiling --threads 2 --shares 0.1 0.2 0.5 1.0

Rates are useful bytes per second, medians over ``--rounds`` interleaved rounds.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.cli_errors import run_main
from online.kernels.native import BASE_FLAGS, HOST_FLAGS, _compiler
from tandem.core.errors import TandemError

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
/* per listed row: la bytes at a + i * sa, then lb bytes at b + i * sb (lb 0: none); returns a checksum */
double touch_rows(const uint8_t *a, int64_t sa, int64_t la, const uint8_t *b, int64_t sb, int64_t lb,
                  const int32_t *idx, int64_t n, int threads, int ahead) {
    double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
        __m256i acc = _mm256_setzero_si256();
        for (int64_t i = lo; i < hi; i++) {
            if (ahead > 0 && i + ahead < hi) {
                int64_t r = idx[i + ahead];
                for (int64_t o = 0; o < la; o += 64) _mm_prefetch((const char *)a + r * sa + o, _MM_HINT_T0);
                for (int64_t o = 0; o < lb; o += 64) _mm_prefetch((const char *)b + r * sb + o, _MM_HINT_T0);
            }
            const uint8_t *p = a + (int64_t)idx[i] * sa, *q = b + (int64_t)idx[i] * sb;
            for (int64_t o = 0; o + 32 <= la; o += 32) acc = _mm256_add_epi8(acc, _mm256_loadu_si256((const __m256i *)(p + o)));
            for (int64_t o = 0; o + 32 <= lb; o += 32) acc = _mm256_add_epi8(acc, _mm256_loadu_si256((const __m256i *)(q + o)));
        }
        int8_t lanes[32];
        _mm256_storeu_si256((__m256i *)lanes, acc);
        for (int k = 0; k < 32; k++) total += lanes[k];
    }
    return total;
}
"""


def build(folder: Path) -> ctypes.CDLL:
    src, out = folder / "touch.c", folder / "touch.so"
    src.write_text(SOURCE)
    proc = subprocess.run([_compiler(), *BASE_FLAGS, *HOST_FLAGS, "-o", str(out), str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise TandemError("cannot build the touch kernel (it needs AVX2): " + (proc.stderr or proc.stdout).strip()[:200])
    lib = ctypes.CDLL(str(out))
    lib.touch_rows.restype = ctypes.c_double
    lib.touch_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--neurons", type=int, default=24 * 2816, help="rows of each matrix (default: llama-350m's FFN)")
    ap.add_argument("--pair-bytes", type=int, default=1152, help="a neuron's gate + up bytes (Q4_0, 1024 wide)")
    ap.add_argument("--down-bytes", type=int, default=2048, help="a neuron's fp16 down row")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.2, 0.5, 1.0])
    ap.add_argument("--ahead", type=int, default=8, help="rows prefetched ahead (0: none)")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    if args.threads < 1 or args.neurons < 16 or args.rounds < 1 or args.ahead < 0:
        raise TandemError("need --threads >= 1, --neurons >= 16, --rounds >= 1, --ahead >= 0")
    if args.pair_bytes < 32 or args.down_bytes < 32 or not all(0 < s <= 1 for s in args.shares):
        raise TandemError("row bytes must be >= 32 and shares in (0, 1]")
    rec = args.pair_bytes + args.down_bytes
    with tempfile.TemporaryDirectory(prefix="tandem-touch-") as tmp:
        lib = build(Path(tmp))
        gen = np.random.default_rng(0)
        pair = gen.integers(0, 255, args.neurons * args.pair_bytes, dtype=np.uint8)  # [N * pair]
        down = gen.integers(0, 255, args.neurons * args.down_bytes, dtype=np.uint8)  # [N * down]
        bundle = gen.integers(0, 255, args.neurons * rec, dtype=np.uint8)  # [N * (pair + down)]
        evict = np.ones(3 * bundle.nbytes // 8)  # read before every pass: the matrices out of the caches
        ptr = lambda a: a.ctypes.data  # noqa: E731

        def timed(layout: str, idx: np.ndarray) -> float:
            evict.sum()
            t0 = time.perf_counter()
            if layout == "separate":
                lib.touch_rows(ptr(pair), args.pair_bytes, args.pair_bytes, ptr(down), args.down_bytes, args.down_bytes,
                               ptr(idx), len(idx), args.threads, args.ahead)
            else:
                lib.touch_rows(ptr(bundle), rec, rec, ptr(bundle), 0, 0, ptr(idx), len(idx), args.threads, args.ahead)
            return len(idx) * rec / (time.perf_counter() - t0)

        print(f"| rows read | gate/up pair + down row apart (GB/s) | one {rec}-byte record per neuron (GB/s) |")
        print("|---|---|---|")
        for share in args.shares:
            rates = {"separate": [], "bundle": []}
            for r in range(args.rounds):
                n = max(1, int(args.neurons * share))
                idx = np.sort(gen.choice(args.neurons, n, replace=False)).astype(np.int32)  # [n]
                for layout in (("separate", "bundle") if r % 2 else ("bundle", "separate")):
                    rates[layout].append(timed(layout, idx))
            print(f"| {share:.0%} | {statistics.median(rates['separate']) / 1e9:.1f} | "
                  f"{statistics.median(rates['bundle']) / 1e9:.1f} |")


if __name__ == "__main__":
    run_main(main)
