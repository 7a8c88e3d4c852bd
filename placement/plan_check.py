"""`tandem show-plan --calibration FILE --measure MODEL`: modeled and measured tok/s side by side.

With a calibration holding per-format rates (`tandem probe --fused`) and ``--measure``, the modeled
line counts the reads of the step the runtime built (placement.step_reads: its packed tensors x the
row shares of the plan's profile and predictors) at those rates.

Example::

    tandem show-plan profiles/M/plan-cpu-only-0 --calibration fused.json --measure M.gguf --threads 2
"""
from __future__ import annotations

from pathlib import Path

from tandem.core.errors import TandemError

from .fused_calibration import calibrated_plan_tokens_per_s, load_calibration
from .step_reads import format_reads, layer_fractions, step_read_terms


def plan_fractions(plan_dir: str | Path, cfg, predictors_dir: str | Path | None = None) -> tuple[list, bool]:
    """(per-layer row fractions, ReLU?) from the profile beside the plan and its predictors (if any)."""
    from offline.profile_artifact import load_profile  # torch: only when a plan is checked

    from .predictor_info import load_predictor_info
    from .settings import ActivationStats

    plan_dir = Path(plan_dir)
    profile_dir = plan_dir.parent / "profile"
    if not profile_dir.is_dir():
        raise TandemError(f"no profile beside the plan ({profile_dir}): the modeled reads need its neuron frequencies")
    stats = ActivationStats.from_profile(load_profile(profile_dir), cfg)
    preds = Path(predictors_dir) if predictors_dir else plan_dir.parent / "predictors"
    info = load_predictor_info(preds, cfg.num_layers) if preds.is_dir() else None
    return layer_fractions(stats.activity, stats.neuron_freq, info), stats.activity == "relu"


def print_modeled_and_measured(plan, args, measure=None) -> None:
    """``measure(model, plan_dir, predictors, threads, want_units=True) -> (tok/s, decode path, (step units,
    config, mean context tokens, KV cache type) or None)``: the runtime's timing (online.plan_measure.measure_plan_tokens_per_s), needed with
    ``args.measure``."""
    modeled = plan.modeled["tokens_per_s"]
    line = [f"tokens/s side by side: modeled (raw cost model) {modeled:.1f}"]
    calibrated, cal = None, None
    if args.calibration:
        cal = load_calibration(args.calibration)
        fmt = "int8" if plan.settings.bytes_per_weight >= 1.0 else "int4"
        calibrated = calibrated_plan_tokens_per_s(plan, cal, fmt)
        line.append("modeled (calibrated): n/a, the plan uses a GPU" if calibrated is None
                    else f"modeled (calibrated, nominal {fmt} bytes, {cal.threads} threads) {calibrated:.1f}")
    reads_line = None
    if args.measure:
        if args.threads is not None and args.threads < 1:
            raise TandemError(f"--threads must be >= 1, got {args.threads}")
        measured, path, step = measure(args.measure, args.plan_dir, args.predictors, args.threads, want_units=True)
        if cal is not None and cal.rates and step is not None and plan.gpu_bytes == 0:
            units, cfg, context, kv_type = step
            fractions, relu = plan_fractions(args.plan_dir, cfg, args.predictors)
            reads, shares, passes, rows = step_read_terms(units, fractions, relu, cfg, context, kv_type)
            reads_line = f"modeled reads per token: {format_reads(reads)}"
            try:
                calibrated = 1.0 / cal.reads_seconds(cfg.num_layers, reads, fractions=shares, passes=passes,
                                                     rows=rows)
                line.append(f"modeled (by packed format) {calibrated:.1f}")
            except TandemError as exc:  # a format the calibration did not time
                line.append(f"modeled (by packed format): n/a ({exc})")
        line.append(f"measured {measured:.1f} ({path} decode path)")
        if calibrated:
            line.append(f"calibrated/measured {calibrated / measured:.2f}")
    print(", ".join(line))
    if reads_line:
        print(reads_line)
