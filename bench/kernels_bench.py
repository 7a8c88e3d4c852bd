"""CPU kernel microbenchmark on SmolLM2-135M shapes (2 threads by default): GEMV per format, FFN time against
sparsity beside the bytes-read limit, and the prefill (T > 1) crossover. Writes bench/kernels.md.

Timings: each candidate runs ``inner`` calls per round, rounds interleave the candidates, the table
shows the median over rounds and the best round (microseconds per call). Torch candidates are timed
apart from the C kernels: torch's OpenMP pool and the C library's are separate runtimes, and alternating them
makes the idle pool's spinning workers steal the cores (milliseconds per switch on a busy machine).
Weights are random (timing does not depend on values); the FFN's active neurons are the ones whose
|h| passes the quantile threshold.

    .venv/bin/python bench/kernels_bench.py [--threads 2,1] [--rounds 15] [--quick]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from online.kernels import cpu_kernels as K  # noqa: E402
from online.kernels.ffn import QuantizedFFN, QuantizedLinear  # noqa: E402
from online.kernels.quantize import Fp32Weight, int8_from_q8_0, quantize_int4, quantize_int8  # noqa: E402

BANDWIDTH_BYTES_PER_S = 32e9  # measured 2-thread read bandwidth of this machine (shared/measurements.md)
D, N_FF = 576, 1536
GEMV_SHAPES = [(1536, 576), (576, 1536), (576, 576), (192, 576), (49152, 576)]
SPARSITIES = [0.0, 0.3, 0.5, 0.7, 0.9]


class Timing(float):
    """Median over rounds (the float value), with the best round kept for display: "median (best)"."""
    best: float

    def __new__(cls, median: float, best: float) -> "Timing":
        obj = super().__new__(cls, median)
        obj.best = best
        return obj

    def __format__(self, spec: str) -> str:
        return f"{format(float(self), spec)} ({format(self.best, spec)})"


def timeit(cands: dict[str, Callable[[], object]], rounds: int, inner: int) -> dict[str, Timing]:
    """Median (and best) over interleaved rounds of the mean time per call, in microseconds."""
    for f in cands.values():
        f()
    samples: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(rounds):
        for k, f in cands.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            samples[k].append((time.perf_counter() - t0) / inner * 1e6)
    return {k: Timing(statistics.median(v), min(v)) for k, v in samples.items()}


def gemv_table(threads: int, rounds: int) -> list[str]:
    rng = np.random.default_rng(0)
    lines = ["| shape (out x in) | torch fp32 | C fp32 | int8 (per row) | int8 (Q8_0 blocks) | int4 (g32) | "
             "int8 bytes-read limit |", "|---|---|---|---|---|---|---|"]
    for out_f, in_f in GEMV_SHAPES:
        w = rng.standard_normal((out_f, in_f)).astype(np.float32)
        x = torch.randn(1, in_f)
        wt = torch.from_numpy(w)
        q8 = int8_from_q8_0(np.full((out_f, in_f // 32), 0.01, np.float16),
                            rng.integers(-127, 128, (out_f, in_f), dtype=np.int8))
        lins = {"C fp32": QuantizedLinear(Fp32Weight(w), threads=threads),
                "int8": QuantizedLinear(quantize_int8(w), threads=threads),
                "int8 blocks": QuantizedLinear(q8, threads=threads),
                "int4": QuantizedLinear(quantize_int4(w, 32), threads=threads)}
        cands = {k: (lambda lin=lin: lin.forward(x)) for k, lin in lins.items()}
        big = out_f > 10000
        r, n = (max(3, rounds // 3), 3) if big else (rounds, 50)
        t = timeit({"torch": lambda: torch.mm(x, wt.T)}, r, n)  # torch apart: see module docstring
        t.update(timeit(cands, r, n))
        limit = lins["int8"].nbytes / BANDWIDTH_BYTES_PER_S * 1e6
        lines.append(f"| {out_f}x{in_f} | {t['torch']:.0f} | {t['C fp32']:.0f} | {t['int8']:.0f} | "
                     f"{t['int8 blocks']:.0f} | {t['int4']:.0f} | {limit:.0f} |")
    return lines


def ffn_table(threads: int, rounds: int) -> list[str]:
    torch.manual_seed(0)
    up, down, gate = torch.randn(N_FF, D) * 0.05, torch.randn(D, N_FF) * 0.05, torch.randn(N_FF, D) * 0.05
    x = torch.randn(1, D)
    h = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)  # [1, n_ff]
    ffns = {fmt: QuantizedFFN.from_float(up=up, down=down, gate=gate, fmt=fmt, threads=threads)
            for fmt in ("fp32", "int8", "int4")}
    torch_dense = lambda: (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T  # noqa: E731
    t_torch = timeit({"t": torch_dense}, rounds, 50)["t"]
    lines = [f"Fused SwiGLU FFN, one token, d={D}, n_ff={N_FF} (gate+up in full, down rows where |h| > t); "
             f"torch fp32 dense (3 matmuls): {t_torch:.0f} us.", "",
             "| sparsity | " + " | ".join(f"{f} us | {f} limit us" for f in ffns) + " |",
             "|---|" + "---|---|" * len(ffns)]
    for s in SPARSITIES:
        thr = float(torch.quantile(h.abs(), s)) if s > 0 else 0.0
        cands = {f: (lambda ffn=ffn: ffn.forward_sparse(x, thr)) for f, ffn in ffns.items()}
        t = timeit(cands, rounds, 50)
        cells = []
        for f, ffn in ffns.items():
            nbytes = (ffn.up.nbytes + ffn.gate.nbytes) + ffn.down_t.nbytes * (1 - s)
            cells.append(f"{t[f]:.0f} | {nbytes / BANDWIDTH_BYTES_PER_S * 1e6:.0f}")
        lines.append(f"| {s:.0%} | " + " | ".join(cells) + " |")
    return lines


def prefill_table(threads: int, rounds: int) -> list[str]:
    """QuantizedLinear 1536x576 for T tokens: C kernel vs dequantize + torch matmul."""
    w = torch.randn(N_FF, D)
    lines = ["| T tokens | torch fp32 (cached float) | int8 C kernel | int8 dequantize + torch | "
             "int4 C kernel | int4 dequantize + torch |", "|---|---|---|---|---|---|"]
    lins = {"int8": QuantizedLinear.from_float(w, "int8", threads=threads),
            "int4": QuantizedLinear.from_float(w, "int4", threads=threads)}
    for T in (1, 2, 4, 8, 16, 64, 200):
        x = torch.randn(T, D)
        xn = x.numpy()
        r = max(3, rounds // 2)
        kernels, deq = {}, {}
        for name, lin in lins.items():
            y = np.empty((T, N_FF), np.float32)
            kernels[f"{name} kernel"] = (lambda lin=lin, y=y: K.gemv_rows(lin._native(), None, xn, y, threads))
            deq[f"{name} deq"] = (lambda lin=lin: x @ lin.dequantize().T)
        t = timeit({"torch": lambda: x @ w.T}, r, 5)
        t.update(timeit(deq, r, 5))
        t.update(timeit(kernels, r, 5))
        lines.append(f"| {T} | {t['torch']:.0f} | {t['int8 kernel']:.0f} | {t['int8 deq']:.0f} | "
                     f"{t['int4 kernel']:.0f} | {t['int4 deq']:.0f} |")
    return lines


def token_table(threads: int, rounds: int) -> list[str]:
    """All linear work of one decoded token: 30 x (fused QKV, O, FFN) + the output layer, each layer
    with its own weights (so the 30 layers stream from memory as in a real decode)."""
    torch.manual_seed(0)
    n_layers, kv = 30, 192
    lines = ["| weights | FFN sparsity | ms per token (kernels only) | weight bytes read | bytes-read limit ms |",
             "|---|---|---|---|---|"]
    x = torch.randn(1, D)
    for fmt, head_fmt in (("int8", "int8"), ("int4", "int8")):
        layers = []
        for _ in range(n_layers):
            qkv = QuantizedLinear.from_float(torch.randn(D + 2 * kv, D), fmt, threads=threads)
            o = QuantizedLinear.from_float(torch.randn(D, D), fmt, threads=threads)
            ffn = QuantizedFFN.from_float(up=torch.randn(N_FF, D), down=torch.randn(D, N_FF),
                                          gate=torch.randn(N_FF, D), fmt=fmt, threads=threads)
            layers.append((qkv, o, ffn))
        head = QuantizedLinear.from_float(torch.randn(49152, D), head_fmt, threads=threads)
        for s in (0.0, 0.5):
            thr = {}
            for i, (_, _, ffn) in enumerate(layers):  # per-layer threshold giving sparsity s on this x
                hv = torch.nn.functional.silu(x @ ffn._lin_gate.dequantize().T) * (x @ ffn._lin_up.dequantize().T)
                thr[i] = float(torch.quantile(hv.abs(), s)) if s > 0 else 0.0

            def token() -> None:
                for i, (qkv, o, ffn) in enumerate(layers):
                    qkv.forward(x)
                    o.forward(x)
                    ffn.forward_sparse(x, thr[i])
                head.forward(x)
            t = timeit({"t": token}, max(3, rounds // 3), 2)["t"]
            ms = Timing(t / 1e3, t.best / 1e3)
            nbytes = sum(q.nbytes + o.nbytes + f.up.nbytes + f.gate.nbytes + f.down_t.nbytes * (1 - s)
                         for q, o, f in layers) + head.nbytes
            lines.append(f"| {fmt} (output layer {head_fmt}) | {s:.0%} | {ms:.2f} | {nbytes / 1e6:.0f} MB | "
                         f"{nbytes / BANDWIDTH_BYTES_PER_S * 1e3:.2f} |")
        del layers, head
    return lines


def section(threads: int, rounds: int) -> list[str]:
    torch.set_num_threads(threads)
    threads = K.clamp_threads(threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    md = [f"### {threads} thread{'s' if threads > 1 else ''} (load average at start {load:.1f})", "",
          "#### GEMV (y = W x)", ""]
    md += gemv_table(threads, rounds)
    md += ["", "#### FFN time against sparsity", ""]
    md += ffn_table(threads, rounds)
    md += ["", "#### One decoded token: every linear layer of SmolLM2-135M", ""]
    md += token_table(threads, rounds)
    md += ["", "#### T > 1 (prefill): 1536x576 projection", ""]
    md += prefill_table(threads, rounds)
    return md + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2", help="comma-separated thread counts, one section each (e.g. 2,1)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "kernels.md")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    md = ["## CPU kernels (SmolLM2-135M shapes)", "",
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, C kernels (OpenMP). "
          f"Microseconds per call: median of {rounds} "
          "interleaved rounds (best round in parentheses). Limits: weight bytes / 32 GB/s (the 2-thread read "
          "bandwidth). Other processes share these 2 cores, so the numbers are noisy; with 2 threads a "
          "parallel region waits whenever the OS parks one of its threads, which shows up as medians "
          "far above the best round. Compare columns of one run.", ""]
    for threads in (int(t) for t in args.threads.split(",")):
        md += section(threads, rounds)
    text = "\n".join(md)
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
