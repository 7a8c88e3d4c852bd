"""`tandem prepare`: profile -> predictors -> plan in one go, reusing what is already built.

Layout: ``<out>/profile``, ``<out>/predictors``, ``<out>/hardware-probed.json``,
``<out>/plan-<hardware>-<budget>``; ``<out>`` defaults to ``profiles/<model-id>``. Each step is
skipped when a valid artifact for the same model (and inputs) is already there.
"""
from __future__ import annotations

import sys
from pathlib import Path

from tandem.errors import ArtifactError, TandemError


def add_parsers(sub) -> None:
    p = sub.add_parser("prepare", help="profile, train predictors and plan in one go (reusing artifacts)")
    p.add_argument("--model", required=True, help="alias (smollm2), .gguf file or Hugging Face folder")
    p.add_argument("--hardware", default=None, help="preset or JSON file (default: probe this machine once)")
    p.add_argument("--gpu-budget", default=None, help="GPU budget, e.g. 2GiB (default: the GPU's free memory, 0 without one)")
    p.add_argument("--out", default=None, help="artifact folder (default profiles/<model-id>)")
    p.add_argument("--predictors", choices=("auto", "on", "off"), default="auto",
                   help="auto: train for ReLU-family models only (on SwiGLU models predictors were measured not to pay)")
    p.add_argument("--tokens", type=int, default=None, help="calibration tokens for profiling/training")
    p.add_argument("--max-quality-loss", type=float, default=0.02)
    p.add_argument("--no-quality", action="store_true", help="plan without measuring its held-out quality")
    p.add_argument("--calib", nargs="+", default=None, metavar="FILE")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(handler=run_prepare)


def _step(argv: list[str]) -> None:
    from tandem.cli import main
    code = main(argv)
    if code != 0:
        raise TandemError(f"`tandem {argv[0]}` failed (exit code {code})")


def _valid_profile(path: Path, fingerprint: str):
    from offline.profile_artifact import load_profile
    try:
        return load_profile(path, expected_model_fingerprint=fingerprint)
    except ArtifactError:
        return None


def _default_budget(hardware_arg: str) -> str:
    import torch
    if torch.cuda.is_available():
        free_bytes, _ = torch.cuda.mem_get_info()
        return str(int(free_bytes * 0.9))
    from placement.hardware import load_hardware
    return "0" if not load_hardware(hardware_arg).has_gpu else None


def run_prepare(args) -> int:
    from online.loading import load_checkpoint
    ckpt = load_checkpoint(args.model)
    cfg, fingerprint, model_id = ckpt.config, ckpt.fingerprint, ckpt.model_id
    del ckpt
    base = Path(args.out) if args.out else Path("profiles") / model_id
    common = ["--model", args.model] + (["--threads", str(args.threads)] if args.threads else [])
    profile_dir = base / "profile"
    if _valid_profile(profile_dir, fingerprint) is not None:
        print(f"[prepare] reusing profile {profile_dir}")
    else:
        extra = (["--tokens", str(args.tokens)] if args.tokens else []) + (["--calib", *args.calib] if args.calib else [])
        _step(["profile", *common, "--out", str(profile_dir), "--max-quality-loss", str(args.max_quality_loss), *extra])
    predictors_dir = None
    if args.predictors == "on" or (args.predictors == "auto" and cfg.ffn_is_relu_sparse):
        predictors_dir = base / "predictors"
        if (predictors_dir / "predictors.json").is_file() and _predictors_valid(predictors_dir, fingerprint, profile_dir):
            print(f"[prepare] reusing predictors {predictors_dir}")
        else:
            _step(["train-predictors", *common, "--profile", str(profile_dir), "--out", str(predictors_dir)])
    hardware = args.hardware
    if hardware is None:
        hardware = str(base / "hardware-probed.json")
        if not Path(hardware).is_file():
            _step(["probe", "--out", hardware] + (["--threads", str(args.threads)] if args.threads else []))
        else:
            print(f"[prepare] reusing hardware profile {hardware}")
    budget = args.gpu_budget if args.gpu_budget is not None else _default_budget(hardware)
    from placement.budget import format_bytes, parse_bytes
    from placement.hardware import load_hardware
    hw = load_hardware(hardware)
    budget_bytes = parse_bytes(budget) if budget is not None else None
    plan_dir = base / f"plan-{hw.name}-{format_bytes(budget_bytes) if budget_bytes is not None else 'default'}"
    plan_argv = ["plan", "--model", args.model, "--profile", str(profile_dir), "--hardware", hardware,
                 "--out", str(plan_dir)] + (["--gpu-budget", str(budget)] if budget is not None else [])
    if predictors_dir is not None:
        plan_argv += ["--predictors", str(predictors_dir)]
    if args.no_quality:
        plan_argv.append("--no-quality")
    if (plan_dir / "plan.json").is_file() and not _plan_matches(plan_dir, fingerprint, profile_dir):
        print(f"[prepare] the plan in {plan_dir} is stale (its profile or model changed): planning again")
        plan_argv.append("--replan")
    _step(plan_argv)
    print(f"[prepare] plan ready: {plan_dir}")
    print(f"run: tandem generate --model {args.model} --plan {plan_dir} --prompt \"...\"")
    sys.stdout.flush()
    return 0


def _predictors_valid(path: Path, fingerprint: str, profile_dir: Path) -> bool:
    try:
        from predictors.artifact import load_predictors
        from offline.profile_artifact import load_profile
        profile = load_profile(profile_dir, expected_model_fingerprint=fingerprint)
        load_predictors(path, expected_model_fingerprint=fingerprint, expected_profile_fingerprint=profile.fingerprint)
        return True
    except (ArtifactError, TandemError, ImportError):
        return False


def _plan_matches(plan_dir: Path, fingerprint: str, profile_dir: Path) -> bool:
    from placement.plan import load_plan
    profile = _valid_profile(profile_dir, fingerprint)
    if profile is None:
        return False
    try:
        load_plan(plan_dir, model_fingerprint=fingerprint, profile_fingerprint=profile.fingerprint)
        return True
    except (ArtifactError, TandemError):
        return False
