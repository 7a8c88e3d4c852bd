"""A MoE GGUF as people download it (Q4_0 experts): Tandem's packed int4 engine against llama.cpp on the same file.

Decode tok/s, load time and peak RSS of each system in its own process, the systems in turn for ``--rounds``
rounds (each round's ratio against llama.cpp's run beside it). The model is ``--gguf``, or a ``tandem synth``
shape written to ``--models-dir`` on first use (default ``mixtral-650m``: 8 layers of 8 experts, top 2, 0.36 GiB
of Q4_0; random weights, so speed and memory only). A packed engine keeps the experts in the file's blocks
(online/experts/block_experts.py); before 2026-11-29 it decoded them to float32 (bench/RESULTS.md).

    python -m bench.moe_gguf --rounds 3 --decode-tokens 64 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.gemma3_bench import PEER_PYTHON, bench_json


def model_path(args) -> str:
    if args.gguf:
        return args.gguf
    from synth import SynthSpec, get_shape, synthesize
    from tandem.core.loading.resolve import resolve_model_path
    out = Path(args.models_dir) / args.shape
    found = sorted(out.glob("*.gguf")) if out.is_dir() else []
    if found:
        return str(found[0])
    return str(synthesize(SynthSpec(get_shape(args.shape), sparsity=0.9), out, str(resolve_model_path("smollm2"))).path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="a MoE GGUF (default: synthesize --shape into --models-dir)")
    ap.add_argument("--shape", default="mixtral-650m")
    ap.add_argument("--models-dir", default="/tmp/tandem-synth-models")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1, help="timed generations per process")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="Tandem only (no bench/peers/venv)")
    args = ap.parse_args()
    from tandem.core.errors import TandemError
    try:
        gguf = model_path(args)
        if not Path(gguf).is_file():
            raise TandemError(f"{gguf} is not a file")
    except (TandemError, OSError) as exc:  # an unknown shape, a missing file: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    timing = ["--threads", str(args.threads), "--runs", str(args.runs), "--decode-tokens", str(args.decode_tokens)]
    tandem = [sys.executable, "-m", "bench.systems.tandem_dense", "--model", gguf, "--weight-format", "int4", *timing]
    rows = [] if args.no_peer else [("llama.cpp", [str(PEER_PYTHON), "bench/systems/llamacpp.py", "--gguf", gguf,
                                                   *timing])]
    rows += [("tandem int4 (fused step)", [*tandem, "--name", "tandem int4"]),
             ("tandem int4 (modules)", [*tandem, "--name", "tandem int4 modules", "--no-fused-decode"])]
    print(f"model {gguf} ({Path(gguf).stat().st_size / 2**20:.0f} MiB), {args.threads} threads, "
          f"{args.decode_tokens} decoded tokens, {args.rounds} rounds")
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in rows}
    for r in range(args.rounds):
        base = None
        for name, cmd in rows:
            rec = bench_json(cmd)
            decode = statistics.median(rec["decode_tok_s"])
            base = base or (decode if name == "llama.cpp" else None)
            results[name].append((decode, rec.get("peak_rss_mb", 0.0), rec.get("load_s", 0.0)))
            ratio = f" ({decode / base:.2f}x llama.cpp)" if base else ""
            print(f"round {r + 1}: {name:26s} decode {decode:7.2f} tok/s{ratio}  peak RSS "
                  f"{rec.get('peak_rss_mb', 0):7.0f} MiB  path {rec.get('decode_path', '-')}", flush=True)
    print("\n| system | decode tok/s (median) | per-round / llama.cpp | peak RSS MiB | load s |")
    print("|---|---|---|---|---|")
    peer = results.get("llama.cpp")
    for name, values in results.items():
        ratio = (f"{statistics.median(v[0] / p[0] for v, p in zip(values, peer)):.2f}x" if peer else "-")
        print(f"| {name} | {statistics.median(v[0] for v in values):.1f} | {ratio} | "
              f"{statistics.median(v[1] for v in values):.0f} | {statistics.median(v[2] for v in values):.1f} |")


if __name__ == "__main__":
    main()
