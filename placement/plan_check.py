"""`tandem show-plan --calibration FILE --measure MODEL`: modeled and measured tok/s side by side.

Example::

    tandem show-plan profiles/M/plan-cpu-only-0 --calibration fused.json --measure M.gguf --threads 2
"""
from __future__ import annotations

from tandem.core.errors import TandemError

from .fused_calibration import calibrated_plan_tokens_per_s, load_calibration

def print_modeled_and_measured(plan, args, measure=None) -> None:
    """``measure(model, plan_dir, predictors, threads) -> (tok/s, decode path)``: the runtime's timing
    (online.plan_measure.measure_plan_tokens_per_s), needed with ``args.measure``."""
    modeled = plan.modeled["tokens_per_s"]
    line = [f"tokens/s side by side: modeled (raw cost model) {modeled:.1f}"]
    calibrated = None
    if args.calibration:
        cal = load_calibration(args.calibration)
        fmt = "int8" if plan.settings.bytes_per_weight >= 1.0 else "int4"
        calibrated = calibrated_plan_tokens_per_s(plan, cal, fmt)
        line.append("modeled (calibrated): n/a, the plan uses a GPU" if calibrated is None
                    else f"modeled (calibrated, {fmt}, {cal.threads} threads) {calibrated:.1f}")
    if args.measure:
        if args.threads is not None and args.threads < 1:
            raise TandemError(f"--threads must be >= 1, got {args.threads}")
        measured, path = measure(args.measure, args.plan_dir, args.predictors, args.threads)
        line.append(f"measured {measured:.1f} ({path} decode path)")
        if calibrated:
            line.append(f"calibrated/measured {calibrated / measured:.2f}")
    print(", ".join(line))
