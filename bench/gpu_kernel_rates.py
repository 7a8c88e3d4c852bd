"""The GPU step's matvec kernels alone at a model's shapes: bytes read per second under the default launch
shapes and under others (rows per program, columns per tile, warps, a rolled column loop, Q4 bytes read whole),
each timed as a CUDA graph of repeated launches. The whole-step rates (bench/RESULTS.md, "Thirteenth session":
~140 GB/s at llama-1b and ~245 at llama-350m on an H200 that reads 4.8 TB/s, ~830 at SmolLM2 on an H100) fall
with the matrix width: the kernels, not the bus, bound a step that runs on the GPU.

``python -m bench.gpu_kernel_rates --shape llama-1b [--out FILE]`` (CUDA and Triton only; exits 2 without).
Matrices as the plans store them: q/k/v/o, gate+up paired and the output layer in Q4_0, down neuron-major in Q8_0.
"""
from __future__ import annotations

import argparse
import itertools
import sys

LAUNCHES_PER_GRAPH = 20


def _time_graph(fn, repeats: int = 15) -> float:
    """Seconds per launch of ``fn`` (one kernel), from a CUDA graph of LAUNCHES_PER_GRAPH of them."""
    from online.gpu.probe_launch import graph_seconds_per_launch
    return graph_seconds_per_launch(fn, LAUNCHES_PER_GRAPH, repeats)


def _bytes(m) -> int:
    return sum(int(t.numel() * t.element_size()) for t in (m.data, m.scale, m.minimum) if t is not None)


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
    from online.gpu.ops import Mat, MatvecLaunch, Ops, default_matvec_launch
    from synth import get_shape
    s = get_shape(args.shape)
    d, kv, ff = s.hidden, s.n_kv_heads * s.head_dim, s.n_ff
    tier = GpuTier.create(1 << 34, "cuda")
    gen = torch.Generator().manual_seed(0)

    def mat(rows: int, cols: int, fmt: str, name: str) -> Mat:
        return Mat.of(TierMatrix.pack(torch.randn(rows, cols, generator=gen) * 0.05, fmt, tier, name))
    cases = {"q / o [d, d]": (mat(d, d, "q4", "q"), None), "k / v [kv, d]": (mat(kv, d, "q4", "k"), None),
             "gate + up [ff, d] paired": (mat(ff, d, "q4", "up"), mat(ff, d, "q4", "gate")),
             "output layer [vocab, d]": (mat(args.vocab, d, "q4", "head"), None)}
    down = mat(ff, d, "q8", "down")
    x, norm = torch.randn(d, device="cuda"), torch.ones(d, device="cuda")
    configs = [MatvecLaunch(br, bc, w, rolled, packed) for br, bc, w, (rolled, packed) in
               itertools.product((4, 8, 16), (128, 256), (4, 8), ((False, False), (True, False), (False, True), (True, True)))]
    lines = [f"# GPU matvec kernels alone: {args.shape} shapes on {torch.cuda.get_device_name(0)}", "",
             "| matrix | bytes | default launch | default GB/s | best launch | best GB/s | best / default |",
             "|---|---|---|---|---|---|---|"]
    for name, (w1, w2) in cases.items():
        y = torch.zeros(w1.rows, device="cuda")
        nbytes = _bytes(w1) + (_bytes(w2) if w2 is not None else 0)

        def run(ops):
            return lambda: ops.matvec(x, w1, y, norm=norm, eps=1e-5, w2=w2, act="silu" if w2 is not None else "none")
        default = default_matvec_launch(w1.rows, w1.cols)
        run(Ops("torch"))()
        want = y.clone()  # the torch twin's result: every launch shape timed must give it
        base = _time_graph(run(Ops("triton")))
        rates = {}
        for c in configs:
            try:
                ops = Ops("triton", matvec_launch=lambda r, k, c=c: c)
                run(ops)()
                if not torch.allclose(y, want, rtol=1e-3, atol=1e-3):
                    print(f"{name}: {c} gives a wrong result (max diff {(y - want).abs().max():.3g}): skipped",
                          file=sys.stderr)
                    continue
                rates[c] = nbytes / _time_graph(run(ops))
            except Exception as exc:  # noqa: BLE001 - a launch shape the compiler refuses (registers) is skipped
                print(f"{name}: {c} failed ({type(exc).__name__})", file=sys.stderr)
        if not rates:
            lines.append(f"| {name} | {nbytes} | {default} | {nbytes / base / 1e9:.0f} | none compiled | - | - |")
            continue
        best = max(rates, key=rates.get)
        lines.append(f"| {name} | {nbytes} | {default} | {nbytes / base / 1e9:.0f} | {best} | {rates[best] / 1e9:.0f} | "
                     f"{rates[best] * base / nbytes:.2f} |")
        print(lines[-1], flush=True)
    h, y = torch.randn(ff, device="cuda"), torch.zeros(d, device="cuda")
    t = _time_graph(lambda: Ops("triton").matvec_t(h, down, y))
    lines.append(f"| down [ff, d] neuron-major (matvec_t) | {_bytes(down)} | default | {_bytes(down) / t / 1e9:.0f} | - | - | - |")
    print(lines[-1])
    if args.out:
        from tandem.core.artifacts import atomic_write_bytes
        atomic_write_bytes(args.out, ("\n".join(lines) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
