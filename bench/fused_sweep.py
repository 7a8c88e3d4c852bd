"""The fused decode step's time per token against FFN sparsity (0-90%), per weight format.

Thresholds for a target sparsity come from the profile's |h| histogram (the uniform quantile the
profiler searches over); every layer gets its quantile threshold and the same 120 decode steps are
timed (median of rounds, real text tokens). Writes bench/fused.md; `python -m bench.fused_sweep`.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
SPARSITIES = (0.0, 0.3, 0.5, 0.7, 0.9)
READ_GB_S = 32.0
TEXT = ("Write a short story about a robot who learns to paint. Once upon a time there was a robot named "
        "Echo who lived in a small town by the sea. Every morning Echo would walk along the beach and watch "
        "the waves roll in, and every evening it tried to paint what it had seen.")


def step_ms(engine, thresholds, ids, rounds: int) -> tuple[float, float]:
    step = engine.compiled_decode
    for i, t in enumerate(thresholds):
        step._layers[i].threshold = float(t)
    cache = engine._kv_cache(len(ids) + 8)
    before = (engine.executor.counters.ffn_neurons_active, engine.executor.counters.ffn_neurons_total)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for pos, tok in enumerate(ids):
            step(tok, pos, cache)
        times.append((time.perf_counter() - t0) / len(ids) * 1e3)
    active = engine.executor.counters.ffn_neurons_active - before[0]
    total = engine.executor.counters.ffn_neurons_total - before[1]
    return statistics.median(times), 1.0 - active / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from offline.profile_artifact import load_profile
    from offline.thresholds import AbsHistogram
    from online import Engine
    from tandem.core.loading import load_checkpoint
    ckpt = load_checkpoint("smollm2")
    profile = load_profile(Path("profiles") / ckpt.model_id / "profile", expected_model_fingerprint=ckpt.fingerprint)
    hist = AbsHistogram(ckpt.config.num_layers)
    hist.counts = profile.tensors["abs_log2_histogram"].double()
    lines = ["## Fused decode step: time per token against FFN sparsity (SmolLM2-135M, measured)", "",
             f"- Date: {dt.date.today().isoformat()}; threads: {args.threads}; command: `python -m bench.fused_sweep`; "
             f"median of {args.rounds} rounds of decode steps over a {len(TEXT.split())}-word text. Every layer gets "
             "the profile's uniform |h| quantile for the target sparsity; the whole step is timed (attention, "
             "FFN, output layer), so the FFN share shows as the slope.", "",
             f"- Bytes-read limit: the weight bytes a token reads at that sparsity (every packed weight, "
             f"down rows only where active) / {READ_GB_S:.0f} GB/s (the 2-thread read bandwidth).", "",
             "| target sparsity | int4: ms / token | int4: achieved | int4: MB read (limit ms) "
             "| int8: ms / token | int8: achieved | int8: MB read (limit ms) |",
             "|---|---|---|---|---|---|---|"]
    rows = {q: [] for q in SPARSITIES}
    for fmt in ("int4", "int8"):
        engine = Engine.load("smollm2", threads=args.threads, weight_format=fmt)
        if engine.decode_path != "fused":
            raise SystemExit(f"no fused decode here: {engine.decode_path_reason}")
        ids = engine.tokenizer.encode(TEXT)
        down_bytes = sum(split.cpu.down_t.nbytes for split in engine.executor.splits)
        step_ms(engine, hist.quantile_thresholds(0.0), ids, 1)  # warm-up
        for q in SPARSITIES:
            thresholds = hist.quantile_thresholds(q) if q > 0 else [-1.0] * ckpt.config.num_layers
            ms, achieved = step_ms(engine, thresholds, ids, args.rounds)
            read = engine.weight_bytes_per_token - down_bytes * achieved
            rows[q].append((ms, achieved, read))
    for q in SPARSITIES:
        cells = [f"{ms:.2f} | {got:.1%} | {read / 1e6:.0f} ({read / READ_GB_S / 1e6:.2f})" for ms, got, read in rows[q]]
        lines.append(f"| {q:.0%} | " + " | ".join(cells) + " |")
    (BENCH_DIR / "fused.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
