"""`tandem prepare`: profile -> predictors -> plan in one go, reusing what is already built.

Layout: ``<out>/profile``, ``<out>/predictors``, ``<out>/hardware-probed.json``,
``<out>/plan-<hardware>-<budget>``; ``<out>`` defaults to ``profiles/<model-id>``. Each step is
skipped when a valid artifact for the same model (and inputs) is already there. The work is
``tandem.pipeline.prepare``; this module only prints. ``--print-plan-path`` sends every progress
line to stderr and prints the plan folder alone on stdout, for scripts::

    plan=$(tandem prepare --model smollm2 --print-plan-path)
    tandem generate --model smollm2 --plan "$plan" --prompt "Hi"
"""
from __future__ import annotations

import contextlib
import sys

from offline.calibration import DEFAULT_MAX_QUALITY_LOSS


def add_parsers(sub) -> None:
    p = sub.add_parser("prepare", help="profile, train predictors and plan in one go (reusing artifacts)")
    p.add_argument("--model", required=True, help="alias (smollm2), .gguf file or Hugging Face folder")
    p.add_argument("--hardware", default=None, help="preset or JSON file (default: probe this machine once)")
    p.add_argument("--gpu-budget", default=None, help="GPU budget, e.g. 2GiB (default: the GPU's free memory, 0 without one)")
    p.add_argument("--out", default=None, help="artifact folder (default profiles/<model-id>)")
    p.add_argument("--predictors", choices=("auto", "on", "off"), default="auto",
                   help="auto: train for ReLU-family models only (on SwiGLU models predictors were measured not to pay)")
    p.add_argument("--tokens", type=int, default=None,
                   help="calibration tokens for a new profile and new predictors (default: the whole corpus)")
    p.add_argument("--max-quality-loss", type=float, default=DEFAULT_MAX_QUALITY_LOSS)
    p.add_argument("--no-quality", action="store_true", help="plan without measuring its held-out quality")
    p.add_argument("--replan", action="store_true",
                   help="plan again even if a plan made for other hardware, predictors or budget is in the way")
    p.add_argument("--calib", nargs="+", default=None, metavar="FILE")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--print-plan-path", action="store_true",
                   help="print only the plan folder on stdout (progress goes to stderr)")
    p.set_defaults(handler=run_prepare)


def run_prepare(args) -> int:
    from offline.cli import format_summary
    from predictors.report import format_report
    from tandem import pipeline

    with contextlib.redirect_stdout(sys.stderr) if args.print_plan_path else contextlib.nullcontext():
        result = pipeline.prepare(args.model, out=args.out, hardware=args.hardware, gpu_budget=args.gpu_budget,
                                  predictors=args.predictors, tokens=args.tokens,
                                  max_quality_loss=args.max_quality_loss, calib=args.calib, threads=args.threads,
                                  quality=not args.no_quality, replan=args.replan,
                                  log=lambda line: print(line, flush=True))
        if not result.profile.reused:
            print(format_summary(result.profile.profile, result.profile.path))
        if result.predictors is not None and not result.predictors.reused:
            print(format_report(result.predictors.predictors, result.predictors.path))
        print(f"[prepare] plan ready: {result.plan.path}")
        print(f"run: tandem generate --model {args.model} --plan {result.plan.path} --prompt \"...\"")
    if args.print_plan_path:
        print(result.plan.path)
    sys.stdout.flush()
    return 0
