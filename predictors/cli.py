"""CLI: ``tandem train-predictors`` (train, size and check activation predictors from a profile)."""
from __future__ import annotations

from pathlib import Path

from tandem.core.errors import TandemError
from offline.calibration import check_max_quality_loss


def add_parsers(sub) -> None:
    p = sub.add_parser("train-predictors", help="train per-layer activation predictors from a profile")
    p.add_argument("--model", required=True, help="alias (smollm2), .gguf file or Hugging Face folder")
    p.add_argument("--profile", required=True, help="profile directory from `tandem profile`")
    p.add_argument("--target-recall", type=float, default=0.95,
                   help="share of active neurons each predictor must catch on held-out tokens (default 0.95)")
    p.add_argument("--out", default=None, help="output directory (default profiles/<model-id>/predictors/)")
    p.add_argument("--tokens", type=int, default=None,
                   help="use at most N calibration tokens (train + held out; default: all of the corpus)")
    p.add_argument("--calib", nargs="+", default=None, metavar="FILE",
                   help="UTF-8 text file(s) to train on (default: the profile's calibration text)")
    p.add_argument("--max-rank", type=int, default=512, help="largest rank of the ladder 16, 32, ... (default 512)")
    p.add_argument("--max-quality-loss", type=float, default=None,
                   help="allowed held-out perplexity increase over dense (default: the profile's budget)")
    p.add_argument("--extra-loss", type=float, default=None,
                   help="allowed increase over the exact path when that already uses the budget (default 0.005)")
    p.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens for the end-to-end check (default 4096)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=run_train_predictors)


def _check_args(args) -> None:
    if not 0.0 < args.target_recall < 1.0:
        raise TandemError(f"--target-recall must be in (0, 1), got {args.target_recall}")
    if args.tokens is not None and args.tokens < 64:
        raise TandemError(f"--tokens must be at least 64, got {args.tokens}")
    if args.max_rank < 16:
        raise TandemError(f"--max-rank must be at least 16, got {args.max_rank}")
    if args.max_quality_loss is not None:
        check_max_quality_loss(args.max_quality_loss)
    if args.extra_loss is not None and not 0.0 <= args.extra_loss <= 1.0:
        raise TandemError(f"--extra-loss must be in [0, 1], got {args.extra_loss}")
    if args.eval_tokens is not None and args.eval_tokens < 16:
        raise TandemError(f"--eval-tokens must be at least 16, got {args.eval_tokens}")
    if not Path(args.profile).is_dir():
        raise TandemError(f"profile directory not found: {args.profile}")


def run_train_predictors(args) -> int:
    _check_args(args)
    from tandem import pipeline
    from .report import format_report

    result = pipeline.train_predictors(args.model, args.profile, out=args.out, calib=args.calib, tokens=args.tokens,
                                       target_recall=args.target_recall, max_rank=args.max_rank,
                                       max_quality_loss=args.max_quality_loss, extra_loss=args.extra_loss,
                                       eval_tokens=args.eval_tokens, threads=args.threads,
                                       progress=not args.no_progress)
    print(format_report(result.predictors, result.path))
    return 0
