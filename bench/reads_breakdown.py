"""The cost model's time per token of one synthetic-bench mode, access by access, beside the measured time.

Loads a synthetic model's plan with predictors as ``bench.synthetic`` does, runs one of its modes (``dense``,
``relu-exact``, ``predictor``: bench/systems/tandem_synthetic.py), and prices the reads it counted (the step's
own packed tensors, by format and access: placement.step_reads) at a fused-step calibration's rates, at the
read bandwidth sampled beside the runs. Where the model and the step disagree, this says which access is off
(perf's per-kernel time on the same mode is the measured side of that split).

    python -m bench.reads_breakdown --model /tmp/synthm/llama-1b-synthetic-s80.Q4_0 --mode predictor \\
        --calibration /tmp/synthm/fused-calibration-2t.json

``--model`` is the GGUF's path without ``.gguf``, with ``plan/`` and ``predictors/`` beside it in a folder of
that name (bench.synthetic's layout).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
from dataclasses import replace
from pathlib import Path

from bench.cli_errors import run_main
from tandem.core.errors import TandemError

MODES = ("dense", "relu-exact", "predictor")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="synthetic GGUF path without .gguf (plan/ and predictors/ in DIR)")
    ap.add_argument("--mode", choices=MODES, default="predictor")
    ap.add_argument("--calibration", required=True, help="tandem probe --fused FILE")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=48)
    args = ap.parse_args()
    base = Path(args.model)
    gguf, plan, predictors = base.with_name(base.name + ".gguf"), base / "plan", base / "predictors"
    for need in (gguf, plan, predictors):
        if not need.exists():
            raise TandemError(f"{need} not found (bench.synthetic's layout: MODEL.gguf, MODEL/plan, MODEL/predictors)")
    if args.runs < 1 or args.decode_tokens < 1 or args.threads < 1:
        raise TandemError("--runs, --decode-tokens and --threads must be >= 1")
    from bench.prompt import BENCH_PROMPT
    from bench.systems.tandem_synthetic import counted_reads, run_bandwidths, run_modes
    from online import Engine
    from placement.fused_calibration import load_calibration
    from placement.probe import measure_read_bandwidth

    cal = load_calibration(args.calibration)
    engine = Engine.load(str(gguf), threads=args.threads, plan=str(plan), predictors=str(predictors))
    if engine.decode_path != "fused":
        raise TandemError(f"no fused decode: {engine.decode_path_reason}")
    step = engine.compiled_decode
    preds = [ctypes.pointer(layer.pred.contents) if layer.pred else None for layer in step._layers]
    ids = engine.tokenizer.encode(BENCH_PROMPT)[:64]
    rec, = run_modes(engine, step, (args.mode,), ids, args.decode_tokens, args.runs, preds,
                     lambda: measure_read_bandwidth("cpu"))
    bandwidth = statistics.median(run_bandwidths(rec))
    context = len(ids) + (args.decode_tokens + 1) / 2
    reads, shares, passes, rows = counted_reads(engine, step, args.mode, rec, context)
    at_run = replace(cal, read_bandwidth_bytes_per_s=bandwidth)
    measured_ms = 1e3 / statistics.median(rec["decode_tok_s"])
    step_bytes = sum(reads.values())
    print(f"{base.name} {args.mode}: measured {measured_ms:.2f} ms/token; read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(calibration's {cal.read_bandwidth_bytes_per_s / 1e9:.1f}); cache speedup on the whole-matrix and KV reads "
          f"{at_run.residency_at(step_bytes):.2f}x")
    print("| format | access | MB/token | row share | bytes a row | rate GB/s | modeled ms |")
    print("|---|---|---|---|---|---|---|")
    for (kind, access), nbytes in sorted(reads.items(), key=lambda kv: -kv[1]):
        kr = at_run.rate(kind, access, shares.get((kind, access)))
        n_rows = rows.get((kind, access))
        seconds = kr.pass_seconds(nbytes, bandwidth, n_rows) / at_run.access_speedup(access, step_bytes)
        row_bytes = nbytes / n_rows if n_rows else float("nan")
        print(f"| {kind} | {access} | {nbytes / 1e6:.1f} | {shares.get((kind, access), 1.0):.3f} | {row_bytes:.0f} | "
              f"{nbytes / seconds / 1e9:.1f} | {1e3 * seconds:.2f} |")
    layers = engine.config.num_layers
    fixed = at_run.reads_seconds(layers, {}, passes=passes)  # the model's own sum: its fixed costs alone, then all
    modeled_ms = 1e3 * at_run.reads_seconds(layers, reads, fractions=shares, passes=passes, rows=rows)
    print(f"fixed costs {1e3 * fixed:.2f} ms ({passes} passes); modeled {modeled_ms:.2f} ms/token; "
          f"modeled / measured tok/s {measured_ms / modeled_ms:.2f}")


if __name__ == "__main__":
    run_main(main)
