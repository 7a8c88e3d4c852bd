"""Gemma 3 270M Q4_K_M: held-out perplexity and decode speed, Tandem vs llama.cpp on the same file.

Run from the repo root (needs bench/peers/venv for llama.cpp; plan from ``tandem prepare --model gemma3``)::

    python -m bench.gemma3_bench --plan profiles/gemma3/plan.json --runs 3
    python -m bench.gemma3_bench --plan profiles/gemma3/plan-probed-0 --skip-perplexity --skip-dense --rounds 5

Perplexity: the calibration corpus's held-out documents in 256-token windows, each scored from its
first token by both systems (same token ids). Decode: bench/systems runners, medians of ``--runs``;
``--rounds`` > 1 runs the systems in turn that many times and reports each system's median ratio to
llama.cpp over the rounds (a busy machine slows neighbouring runs alike, so the ratio holds better
than any one speed).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

PEER_PYTHON = Path("bench/peers/venv/bin/python")


def bench_json(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("BENCH_JSON ")][-1][11:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--skip-perplexity", action="store_true")
    ap.add_argument("--skip-dense", action="store_true", help="no dense fp32 decode row (the slowest)")
    ap.add_argument("--rounds", type=int, default=1, help="run every system this many times, in turn")
    args = ap.parse_args()
    from tandem.core.loading.resolve import resolve_model_path
    gguf = str(resolve_model_path("gemma3"))
    if not args.skip_perplexity:
        perplexity(gguf, args)
    timings(gguf, args)


def perplexity(gguf: str, args) -> None:
    from bench.systems.quality import held_out_windows
    from online import Engine
    engine = Engine.load("gemma3", threads=args.threads)
    windows = held_out_windows(engine, args.window)
    nll, count = 0.0, 0
    for w in windows:
        logits = engine.logits(w)  # [T, vocab]
        nll += float(F.cross_entropy(logits[:-1].double(), torch.tensor(w[1:]), reduction="sum"))
        count += len(w) - 1
    ours = math.exp(nll / count)
    del engine
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(windows, f)
    peer = bench_json([str(PEER_PYTHON), "bench/systems/llamacpp_ppl.py", "--gguf", gguf, "--windows", f.name,
                       "--threads", str(args.threads)])
    print(f"held-out perplexity over {count} tokens: tandem {ours:.4f}, llama.cpp {peer['perplexity']:.4f} "
          f"(ratio {ours / peer['perplexity']:.4f})")


def timings(gguf: str, args) -> None:
    timing = ["--threads", str(args.threads), "--runs", str(args.runs), "--decode-tokens", str(args.decode_tokens)]
    tandem = [sys.executable, "-m", "bench.systems.tandem_dense", "--model", "gemma3"]
    rows = [("llama.cpp", [str(PEER_PYTHON), "bench/systems/llamacpp.py", "--gguf", gguf, *timing])]
    if not args.skip_dense:
        rows.append(("tandem dense fp32", [*tandem, *timing]))
    if args.plan:
        plan = [*tandem, "--plan", args.plan, "--weight-format", "int8", *timing]
        rows.append(("tandem plan int8 sparse", plan))
        rows.append(("tandem plan int8 sparse (modules)", [*plan, "--no-fused-decode"]))
    ratios: dict[str, list[float]] = {name: [] for name, _ in rows}
    for r in range(args.rounds):
        base = None
        for name, cmd in rows:
            rec = bench_json(cmd)
            decode = statistics.median(rec["decode_tok_s"])
            base = base or decode
            ratios[name].append(decode / base)
            print(f"round {r + 1}: {name:36s} decode {decode:7.2f} tok/s ({decode / base:.2f}x llama.cpp)  "
                  f"prefill {statistics.median(rec['prefill_tok_s']):7.1f} tok/s  path {rec.get('decode_path', '-')}",
                  flush=True)
    if args.rounds > 1:
        for name, values in ratios.items():
            print(f"median over {args.rounds} rounds: {name:36s} {statistics.median(values):.2f}x llama.cpp")


if __name__ == "__main__":
    main()
