"""CLI: ``tandem profile`` (build a profile artifact) and ``tandem show-profile DIR`` (print its summary)."""
from __future__ import annotations

from pathlib import Path

from tandem.core.errors import ArtifactError, TandemError
from offline.calibration import DEFAULT_MAX_QUALITY_LOSS


def add_parsers(sub) -> None:
    p = sub.add_parser("profile", help="profile FFN activations, sparsity thresholds and MoE routing on calibration text")
    p.add_argument("--model", required=True, help="alias (smollm2), .gguf file or Hugging Face folder")
    p.add_argument("--calib", nargs="+", default=None, metavar="FILE",
                   help="UTF-8 text file(s) to calibrate on (default: the shipped corpus)")
    p.add_argument("--tokens", type=int, default=None, help="use at most N tokens of the calibration text (train + held out; self-generated text comes on top)")
    p.add_argument("--self-generated", type=int, default=0, metavar="N",
                   help="add about N tokens the model generates from shipped seed prompts (training split only)")
    p.add_argument("--max-quality-loss", type=float, default=DEFAULT_MAX_QUALITY_LOSS,
                   help="allowed perplexity increase for non-ReLU thresholds (default 0.02 = 2%%); the "
                        "search on the training windows aims at 75%% of it, held-out text re-measures it")
    p.add_argument("--window", type=int, default=256, help="tokens per calibration window (default 256)")
    p.add_argument("--search-steps", type=int, default=7, help="bisection steps of the threshold search (default 7)")
    p.add_argument("--plot", action="store_true", help="also write DIR/profile.png")
    p.add_argument("--out", default=None, help="output directory (default profiles/<model-id>/profile/)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_profile)

    s = sub.add_parser("show-profile", help="print the summary of a profile artifact")
    s.add_argument("dir", help="profile directory (holds profile.json + profile.safetensors)")
    s.set_defaults(handler=run_show_profile)


def run_profile(args) -> int:
    from tandem import pipeline

    if args.window < 2:
        raise TandemError(f"--window must be at least 2, got {args.window}")
    if args.self_generated < 0:
        raise TandemError(f"--self-generated must be >= 0, got {args.self_generated}")
    if args.search_steps < 1:
        raise TandemError(f"--search-steps must be >= 1, got {args.search_steps}")
    result = pipeline.profile(args.model, out=args.out, calib=args.calib, tokens=args.tokens,
                              self_generated_tokens=args.self_generated, max_quality_loss=args.max_quality_loss,
                              window_tokens=args.window, search_steps=args.search_steps, threads=args.threads,
                              progress=not args.no_progress, plot=args.plot)
    print(format_summary(result.profile, result.path))
    return 0


def run_show_profile(args) -> int:
    from .profile_artifact import load_profile
    profile = load_profile(args.dir)
    try:  # a field of the wrong type in a profile older than the content checksum (tandem/core/artifacts.py)
        summary = format_summary(profile, Path(args.dir))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ArtifactError(f"profile metadata in {args.dir} is malformed ({e}); run `tandem profile` again") from None
    print(summary)
    return 0


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"


def _num(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_summary(profile, profile_dir: Path) -> str:
    """The human-readable summary printed by ``tandem profile`` and ``tandem show-profile``."""
    cal, q = profile.calibration, profile.quality
    lines = [f"profile: {profile_dir}",
             f"model: {profile.model_id} (fingerprint {profile.model_fingerprint})",
             "activity: " + ("exact zeros (ReLU family)" if profile.activity == "relu"
                             else "|h| above a calibrated per-layer threshold (h = input of the down projection)")]
    source = cal.get("kind", "?")
    if source == "files":
        source = "files " + ", ".join(f["path"] for f in cal.get("files", []))
    elif source == "builtin":
        source = f"shipped corpus ({cal.get('documents', '?')} documents, {cal.get('chat_documents', '?')} chat)"
    if cal.get("self_generated_tokens"):
        source += f" + {cal['self_generated_tokens']} self-generated tokens"
    lines.append(f"calibration: {source}; {cal.get('train_tokens', '?')} train + {cal.get('held_out_tokens', '?')} "
                 f"held-out tokens, windows of {cal.get('window_tokens', '?')}")
    if q:
        ppl = f"held-out perplexity {q.get('dense_perplexity', 0):.3f}"
        if profile.activity == "threshold":
            ppl += (f" -> {q.get('sparse_perplexity', 0):.3f} ({q.get('perplexity_increase', 0):+.2%}) at uniform "
                    f"sparsity {q.get('uniform_sparsity', 0):.1%} (budget {q.get('max_quality_loss', 0):.1%})")
        lines.append(f"quality: {ppl}; achieved sparsity {_pct(q.get('train_sparsity'))} calibration, "
                     f"{_pct(q.get('held_out_sparsity'))} held out")
        if q.get("search"):
            lines.append("search (training windows): "
                         + ", ".join(f"{p['sparsity']:.1%}->{p['increase']:+.2%}" for p in q["search"]))
        draft = q.get("draft")
        if draft:
            lines.append(f"draft thresholds (speculative self-drafting): uniform sparsity {draft['uniform_sparsity']:.1%}, "
                         f"{draft['selection_perplexity_increase']:+.2%} on the training windows "
                         f"(budget {draft['max_quality_loss']:.0%})")
    if profile.extra.get("mean_skew") is not None:
        lines.append(f"skew: on average {profile.extra['mean_skew']:.1%} of a layer's neurons carry "
                     f"{profile.extra.get('skew_mass', 0.8):.0%} of its activations (a flat spread: "
                     f"{profile.extra.get('skew_mass', 0.8):.0%})")
    moe = any(layer.get("kind") == "moe" for layer in profile.layers)
    header = f"{'layer':>5} {'threshold':>10} {'sparsity':>9} {'held-out':>9} {'skew80':>7} {'hot20':>7}"
    if moe:
        header += f" {'repeat':>7} {'kept':>7} {'spec+1':>7} {'spec+2':>7}"
    lines.append(header)
    for layer in profile.layers:
        row = (f"{layer['layer']:>5} {_num(layer.get('threshold'), '{:.4g}'):>10} {_pct(layer.get('sparsity')):>9} "
               f"{_pct(layer.get('held_out_sparsity')):>9} {_num(layer.get('skew')):>7} {_num(layer.get('hot20_share')):>7}")
        if moe:
            row += "".join(f" {_num(layer.get(k)):>7}" for k in ("expert_repeat", "expert_kept", "spec_recall_1", "spec_recall_2"))
        lines.append(row)
    timings = profile.extra.get("timings_s")
    if timings:
        lines.append("time: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in timings.items())
                     + (f"; total {profile.extra['wall_s']:.1f} s wall, {profile.extra.get('cpu_s', 0):.1f} s CPU"
                        if profile.extra.get("wall_s") else ""))
    png = profile_dir / "profile.png"
    if png.is_file():
        lines.append(f"picture: {png}")
    return "\n".join(lines)
