"""Tandem's engine: prefill and decode timings, repeated runs in one process; with ``--calibration`` (a
`tandem probe --fused` file) also the cost model's tok/s for the fused step the engine built, one per timed run
at the read bandwidth sampled just before it (placement.step_reads: the step's packed tensors at the row shares
of the plan's profile; every row without a plan)."""
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
    prefill, decode, bandwidths = [], [], []
    for _ in range(args.runs):
        if args.calibration:
            with torch_threads(args.threads):
                bandwidths.append(measure_read_bandwidth("cpu"))
        out = engine.generate(prompt_ids, max_new_tokens=args.decode_tokens, ignore_eos=True)
        prefill.append(out.stats["prefill_tokens_per_s"])
        decode.append(out.stats["decode_tokens_per_s"])
    emit({"system": args.name, "prompt_tokens": len(prompt_ids), "ffn_sparsity": out.stats.get("ffn_sparsity"),
          "decode_tokens": args.decode_tokens, "prefill_tok_s": prefill, "decode_tok_s": decode,
          "load_s": round(load_s, 2), "weight_bytes_per_token": engine.weight_bytes_per_token,
          "bytes_moved_per_token": out.stats.get("bytes_moved_per_token", 0), "decode_path": engine.decode_path,
          **(modeled(engine, args, len(prompt_ids), bandwidths) if args.calibration else {})})


def modeled(engine, args, prompt_tokens: int, bandwidths: list[float]) -> dict:
    """{"modeled_tok_s": [the calibration's terms applied to the fused step's reads at each of ``bandwidths``],
    "read_bandwidth_samples": bandwidths} (empty for another decode path, or a read the calibration did not time)."""
    from dataclasses import replace

    from online.step_inventory import step_units
    from placement.fused_calibration import load_calibration
    from placement.plan_check import plan_fractions
    from placement.step_reads import step_read_terms
    from tandem.core.errors import TandemError

    if engine.decode_path != "fused":
        return {}
    cal = load_calibration(args.calibration)
    cfg, units = engine.config, step_units(engine.compiled_decode, engine.config)
    fractions, relu = plan_fractions(args.plan, cfg) if args.plan and not args.no_sparse else (None, False)
    context = prompt_tokens + (args.decode_tokens + 1) / 2  # keys a decode step attends to, on average
    reads, shares, passes = step_read_terms(units, fractions, relu, cfg, context, engine.kv_cache_type)
    try:
        rates = [1.0 / replace(cal, read_bandwidth_bytes_per_s=b).reads_seconds(cfg.num_layers, reads, fractions=shares,
                                                                              passes=passes) for b in bandwidths]
    except TandemError:
        return {}
    return {"modeled_tok_s": rates, "read_bandwidth_samples": bandwidths}


if __name__ == "__main__":
    main()
