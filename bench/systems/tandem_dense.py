"""Tandem's engine: prefill and decode timings, repeated runs in one process; with ``--calibration`` (a
`tandem probe --fused` file) also the cost model's tok/s for the fused step the engine built (placement.step_reads:
the step's packed tensors at the row shares of the plan's profile; every row without a plan), one per timed run
at the host's state sampled just before it: torch's read bandwidth (as the synthetic table's model and bytes
limits take it) and the cache's speedup on the step's bytes per token (online.residency_probe: a Q4_1 pass over
them right after another, against one after an eviction). The evicted pass's rate is recorded too, with the model
at the bandwidth it implies (its rate over the calibration's Q4_1 dense share): over 10-30-run series on the
Intel VM neither input followed the decode rate much better (modeled / measured varied by CV 0.10-0.17 either
way), and the Q4 kernel's rate moves with the core's compute as well, which int8 rows do not feel.
"""
from __future__ import annotations

import time

from bench.prompt import BENCH_PROMPT
from bench.systems.common import emit, timing_arguments


def main() -> None:
    ap = timing_arguments(__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--plan", default=None)
    ap.add_argument("--weight-format", default=None)
    ap.add_argument("--name", default="tandem dense fp32")
    ap.add_argument("--no-fused-decode", action="store_true")
    ap.add_argument("--no-sparse", action="store_true")
    ap.add_argument("--calibration", help="fused-step calibration (tandem probe --fused): the modeled tok/s too")
    args = ap.parse_args()
    from online import Engine
    from placement.probe import measure_read_bandwidth, torch_threads
    t0 = time.perf_counter()
    engine = Engine.load(args.model, threads=args.threads, plan=args.plan, weight_format=args.weight_format,
                         fused_decode=not args.no_fused_decode, sparse=not args.no_sparse)
    load_s = time.perf_counter() - t0
    prompt_ids = engine.tokenizer.encode(BENCH_PROMPT)
    engine.generate(prompt_ids, max_new_tokens=8, ignore_eos=True)  # warm-up
    terms = step_terms(engine, args, len(prompt_ids)) if args.calibration else None
    residency_probe = None
    if terms is not None:
        from online.residency_probe import RESIDENCY_SIZES, ResidencyProbe
        residency_probe = ResidencyProbe(args.threads, min(terms[4], RESIDENCY_SIZES[-1]))
    prefill, decode, samples = [], [], []
    for _ in range(args.runs):
        if terms is not None:
            with torch_threads(args.threads):
                samples.append((measure_read_bandwidth("cpu"), *host_state(residency_probe, terms[4])))
        out = engine.generate(prompt_ids, max_new_tokens=args.decode_tokens, ignore_eos=True)
        prefill.append(out.stats["prefill_tokens_per_s"])
        decode.append(out.stats["decode_tokens_per_s"])
    emit({"system": args.name, "prompt_tokens": len(prompt_ids), "ffn_sparsity": out.stats.get("ffn_sparsity"),
          "decode_tokens": args.decode_tokens, "prefill_tok_s": prefill, "decode_tok_s": decode,
          "load_s": round(load_s, 2), "weight_bytes_per_token": engine.weight_bytes_per_token,
          "bytes_moved_per_token": out.stats.get("bytes_moved_per_token", 0), "decode_path": engine.decode_path,
          **(modeled(engine, args, terms, samples) if terms is not None else {})})


def step_terms(engine, args, prompt_tokens: int) -> tuple | None:
    """(calibration, reads, shares, passes, bytes per token, rows) of the fused step the engine built (None
    for another decode path, or a read the calibration did not time)."""
    from online.step_inventory import step_units
    from placement.fused_calibration import load_calibration
    from placement.plan_check import plan_fractions
    from placement.step_reads import step_read_terms
    from tandem.core.errors import TandemError

    if engine.decode_path != "fused":
        return None
    cal = load_calibration(args.calibration)
    cfg, units = engine.config, step_units(engine.compiled_decode, engine.config)
    fractions, relu = plan_fractions(args.plan, cfg) if args.plan and not args.no_sparse else (None, False)
    context = prompt_tokens + (args.decode_tokens + 1) / 2  # keys a decode step attends to, on average
    reads, shares, passes, rows = step_read_terms(units, fractions, relu, cfg, context, engine.kv_cache_type)
    try:
        cal.reads_seconds(cfg.num_layers, reads, fractions=shares, passes=passes, rows=rows)
        cal.rate("q4_1", "dense")  # the host-state sample's kernel
    except TandemError:
        return None
    return cal, reads, shares, passes, float(sum(reads.values())), rows


def host_state(probe, step_bytes: float, pairs: int = 5) -> tuple[float, float]:
    """(bytes per second of the Q4_1 dense kernel over ``step_bytes`` after an eviction, the cache's speedup on
    them): medians of ``pairs`` evicted / warm pass pairs (online.residency_probe)."""
    evicted, warm = probe.median_pair(step_bytes, pairs)
    return probe.pass_bytes(step_bytes) / evicted, evicted / warm


def modeled(engine, args, terms: tuple, samples: list[tuple[float, float, float]]) -> dict:
    """{"modeled_tok_s": [the calibration's terms applied to the fused step's reads at each run's sampled host
    state: torch's read bandwidth and the cache's speedup on the step's bytes per token],
    "modeled_tok_s_kernel_bandwidth": [the same at the bandwidth the Q4_1 kernel's evicted pass implies (its rate
    / the calibration's Q4_1 dense share)], "read_bandwidth_samples" (torch sum), "kernel_read_samples",
    "residency_samples"}."""
    from dataclasses import replace

    cal, reads, shares, passes, step_bytes, rows = terms
    q4_share = cal.rate("q4_1", "dense").share

    def tok_s(bandwidth: float, speedup: float) -> float:
        table = ((max(1, int(step_bytes)), min(max(speedup, 1.0), 49.0)),)  # the model clamps it at 1 anyway
        at = replace(cal, read_bandwidth_bytes_per_s=bandwidth, residency=table)
        return 1.0 / at.reads_seconds(engine.config.num_layers, reads, fractions=shares, passes=passes, rows=rows)

    return {"modeled_tok_s": [tok_s(b, r) for b, _, r in samples],
            "modeled_tok_s_kernel_bandwidth": [tok_s(k / q4_share, r) for _, k, r in samples],
            "read_bandwidth_samples": [b for b, _, _ in samples], "kernel_read_samples": [k for _, k, _ in samples],
            "residency_samples": [round(r, 4) for _, _, r in samples]}


if __name__ == "__main__":
    main()
