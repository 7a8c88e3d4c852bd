"""The GPU step's matvec kernels alone at a model's shapes: bytes read per second under the launch shapes the
step is measured with (the defaults: one byte load per weight), under the candidate word reads
(``word_launches``: quantized rows as 32-bit words) and under others (rows per program, columns per tile, warps;
Q4 rows read as whole bytes), each timed as a CUDA graph of repeated launches and first checked against the
default launch's result. The
whole-step rates of the thirteenth session (~140 GB/s at llama-1b on an H200 that reads 4.8 TB/s) are what this
explains: the kernels, not the bus, bound a step that runs on the GPU.

``python -m bench.gpu_kernel_rates --shape llama-1b [--out FILE]`` (CUDA and Triton only; exits 2 without).
Matrices as the plans store them: q/k/v/o, gate+up paired and the output layer in Q4_0, down neuron-major in Q8_0.
``bench.gpu_kernels_ab`` sweeps the same launches over a loaded model's own matrices and times whole steps.
"""
from __future__ import annotations

import argparse
import sys

LAUNCHES_PER_GRAPH = 20


def word_launches():
    """The candidate defaults: (matvec, matvec_t) policies reading quantized rows as 32-bit words: 16 rows x 512
    columns a program for matrices over 1,024 rows (each thread's words then come as 16-byte loads, which
    tests/test_gpu_compile.py checks in the sm_90 PTX), 8 x 256 below; 128 columns per down program."""
    from online.gpu.ops import MatvecLaunch, MatvecTLaunch, _pow2
    return (lambda r, c: MatvecLaunch(16, 512, 4, words=True) if r > 1024 and c >= 512 else
            MatvecLaunch(8, 256 if c >= 256 else _pow2(c), 4, words=True),
            lambda r, c: MatvecTLaunch(cols_per_program=128, words=True))


def matvec_configs():
    from online.gpu.ops import MatvecLaunch
    shapes = ((4, 256, 4), (8, 256, 4), (16, 256, 4), (32, 256, 8), (4, 512, 4), (8, 512, 4), (16, 512, 8),
              (32, 512, 8), (8, 1024, 8), (16, 128, 4))  # rows per program, columns per tile, warps
    words = [MatvecLaunch(br, bc, w, words=True) for br, bc, w in shapes]
    return words + [MatvecLaunch(br, 256, 4, packed=True) for br in (8, 16)]


def matvec_t_configs():
    from online.gpu.ops import MatvecTLaunch
    return [MatvecTLaunch(bc, br, rows, w, words=True) for bc, br, rows, w in
            ((64, 32, 256, 4), (128, 32, 256, 4), (256, 32, 256, 8), (128, 16, 128, 4), (128, 32, 128, 4),
             (256, 16, 256, 4), (64, 16, 128, 4), (512, 16, 128, 8))] + [MatvecTLaunch(128, 32, 256, 4)]


def time_graph(fn, repeats: int = 15) -> float:
    """Seconds per launch of ``fn`` (one kernel), from a CUDA graph of LAUNCHES_PER_GRAPH of them."""
    from online.gpu.probe_launch import graph_seconds_per_launch
    return graph_seconds_per_launch(fn, LAUNCHES_PER_GRAPH, repeats)


def mat_bytes(m) -> int:
    return sum(int(t.numel() * t.element_size()) for t in (m.data, m.scale, m.minimum) if t is not None)


def sweep(kind: str, x, w1, y, kwargs: dict, configs: list) -> dict:
    """{"default": s, "words": s, launch: s, ...} seconds per launch of one recorded call (``kind`` "matvec" or
    "matvec_t") under the defaults, the candidate word launches and each of ``configs``; a launch whose result
    differs from the default's is left out (said on stderr). ``y`` (and an in-place residual) is restored before
    each."""
    import torch

    from online.gpu.ops import Ops
    words_mv, words_t = word_launches()
    start = y.clone()

    def ops_for(launch):
        if launch == "default":
            return Ops("triton")
        if launch == "words":
            return Ops("triton", matvec_launch=words_mv, matvec_t_launch=words_t)
        return Ops("triton", matvec_launch=lambda r, c: launch) if kind == "matvec" else \
            Ops("triton", matvec_t_launch=lambda r, c: launch)

    def call(ops):
        def run():
            if kind == "matvec":
                ops.matvec(x, w1, y, **kwargs)
            else:
                ops.matvec_t(x, w1, y, **kwargs)
        return run
    want, out = None, {}
    for launch in ["default", "words", *configs]:
        try:
            ops = ops_for(launch)
            y.copy_(start)
            call(ops)()
            got = y.clone()
            if want is None:
                want = got
            elif not torch.allclose(got, want, rtol=2e-3, atol=2e-3):
                print(f"{kind} {w1.rows}x{w1.cols}: {launch} gives another result (max diff "
                      f"{(got - want).abs().max():.3g}): skipped", file=sys.stderr)
                continue
            out[launch] = time_graph(call(ops))
        except Exception as exc:  # noqa: BLE001 - a launch shape the compiler refuses (registers) is skipped
            print(f"{kind} {w1.rows}x{w1.cols}: {launch} failed ({type(exc).__name__}: {exc})"[:300], file=sys.stderr)
    y.copy_(start)
    return out


def short(launch) -> str:
    """``words 16x256 w4``: how rows are read, rows x columns (per program / tile), warps."""
    if isinstance(launch, str):
        return launch
    if hasattr(launch, "rows_per_program"):
        how = "words" if launch.words else ("packed" if launch.packed else "bytes")
        rolled = " rolled" if launch.rolled else ""
        return f"{how} {launch.rows_per_program}x{launch.cols_per_tile} w{launch.warps}{rolled}"
    return (f"{'words' if launch.words else 'bytes'} {launch.rows_per_step}x{launch.cols_per_program} "
            f"<= {launch.max_rows_per_program} rows w{launch.warps}")


def rate_line(name: str, nbytes: int, seconds: dict) -> tuple[str, object]:
    """A markdown row (default / words / best GB/s, us a launch) and the best launch."""
    tried = {k: v for k, v in seconds.items() if k != "default"}
    best = min(tried, key=tried.get) if tried else "default"
    gbs = {k: nbytes / v / 1e9 for k, v in seconds.items()}
    nan = float("nan")

    def rate(k):
        return f"{gbs.get(k, nan):.0f} ({seconds.get(k, nan) * 1e6:.1f} us)"
    return (f"| {name} | {nbytes} | {rate('default')} | {rate('words')} | {short(best)} | {rate(best)} | "
            f"{gbs.get(best, nan) / gbs.get('default', nan):.2f} |", best)


HEADER = ["| matrix | bytes | default GB/s (us a launch) | words GB/s | best launch | best GB/s | best / default |",
          "|---|---|---|---|---|---|---|"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-1b", help="a `tandem synth` shape")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("error: bench.gpu_kernel_rates needs CUDA (and Triton)", file=sys.stderr)
        return 2
    from online.execution.gpu_tier import GpuTier
    from online.execution.tier_matrix import TierMatrix
    from online.gpu.ops import Mat
    from synth import get_shape
    s = get_shape(args.shape)
    d, kv, ff = s.hidden, s.n_kv_heads * s.head_dim, s.n_ff
    tier = GpuTier.create(1 << 34, "cuda")
    gen = torch.Generator().manual_seed(0)

    def mat(rows: int, cols: int, fmt: str, name: str) -> Mat:
        return Mat.of(TierMatrix.pack(torch.randn(rows, cols, generator=gen) * 0.05, fmt, tier, name))
    x, norm = torch.randn(d, device="cuda"), torch.ones(d, device="cuda")
    lines = [f"# GPU matvec kernels alone: {args.shape} shapes on {torch.cuda.get_device_name(0)}", "", *HEADER]
    cases = {"q / o [d, d]": (mat(d, d, "q4", "q"), None), "k / v [kv, d]": (mat(kv, d, "q4", "k"), None),
             "gate + up [ff, d] paired": (mat(ff, d, "q4", "up"), mat(ff, d, "q4", "gate")),
             "output layer [vocab, d]": (mat(args.vocab, d, "q4", "head"), None)}
    for name, (w1, w2) in cases.items():
        y = torch.zeros(w1.rows, device="cuda")
        kwargs = dict(norm=norm, eps=1e-5, w2=w2, act="silu" if w2 is not None else "none")
        seconds = sweep("matvec", x, w1, y, kwargs, matvec_configs())
        lines.append(rate_line(name, mat_bytes(w1) + (mat_bytes(w2) if w2 is not None else 0), seconds)[0])
        print(lines[-1], flush=True)
    down = mat(ff, d, "q8", "down")
    h, y = torch.randn(ff, device="cuda"), torch.zeros(d, device="cuda")
    seconds = sweep("matvec_t", h, down, y, {}, matvec_t_configs())
    lines.append(rate_line("down [ff, d] neuron-major (matvec_t)", mat_bytes(down), seconds)[0])
    print(lines[-1])
    if args.out:
        from tandem.core.artifacts import atomic_write_bytes
        atomic_write_bytes(args.out, ("\n".join(lines) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
