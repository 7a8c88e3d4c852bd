"""`tandem show-plan --calibration FILE --measure MODEL`: modeled and measured tok/s side by side.

Example::

    tandem show-plan profiles/M/plan-cpu-only-0 --calibration fused.json --measure M.gguf --threads 2
"""
from __future__ import annotations

import time

from tandem.core.errors import TandemError

MEASURE_TOKENS = 32


def measure_plan_tokens_per_s(model: str, plan_dir: str, predictors: str | None, threads: int | None) -> tuple[float, str]:
    """(decode tok/s over MEASURE_TOKENS greedy tokens after a short prompt, decode path)."""
    from online import Engine

    engine = Engine.load(model, threads=threads, plan=plan_dir, predictors=predictors)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    engine.generate(prompt, max_new_tokens=4, ignore_eos=True)  # warm-up (native build, caches)
    t0 = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=MEASURE_TOKENS, ignore_eos=True)
    rate = out.stats.get("decode_tokens_per_s") if hasattr(out, "stats") else None
    if not rate:
        rate = MEASURE_TOKENS / (time.perf_counter() - t0)
    return float(rate), engine.decode_path


def print_modeled_and_measured(plan, args) -> None:
    modeled = plan.modeled["tokens_per_s"]
    line = [f"tokens/s side by side: modeled (raw cost model) {modeled:.1f}"]
    calibrated = None
    if args.calibration:
        from .fused_calibration import calibrated_plan_tokens_per_s, load_calibration
        cal = load_calibration(args.calibration)
        fmt = "int8" if plan.settings.bytes_per_weight >= 1.0 else "int4"
        calibrated = calibrated_plan_tokens_per_s(plan, cal, fmt)
        line.append("modeled (calibrated): n/a, the plan uses a GPU" if calibrated is None
                    else f"modeled (calibrated, {fmt}, {cal.threads} threads) {calibrated:.1f}")
    if args.measure:
        if args.threads is not None and args.threads < 1:
            raise TandemError(f"--threads must be >= 1, got {args.threads}")
        measured, path = measure_plan_tokens_per_s(args.measure, args.plan_dir, args.predictors, args.threads)
        line.append(f"measured {measured:.1f} ({path} decode path)")
        if calibrated:
            line.append(f"calibrated/measured {calibrated / measured:.2f}")
    print(", ".join(line))
