"""Human-readable summary of a predictor set (printed by ``tandem train-predictors``).

Example::

    print(format_report(load_predictors(dir, None), dir))
"""
from __future__ import annotations

from pathlib import Path

from .model import PredictorSet


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_report(pset: PredictorSet, out_dir: Path | str) -> str:
    m = pset.meta
    lines = [f"predictors: {out_dir}",
             f"model: {m.get('model_id')} (fingerprint {m.get('model_fingerprint')}); profile "
             f"{m.get('profile_fingerprint')} ({m.get('activity')}); target recall {m.get('target_recall')}, "
             f"recall levels {m.get('recall_levels')}"]
    cal = m.get("calibration", {})
    if cal:
        lines.append(f"tokens: {cal.get('train_tokens')} train, {cal.get('val_tokens')} validation, "
                     f"{cal.get('held_out_tokens')} held-out scored (windows of {cal.get('window_tokens')})")
    lines.append(f"{'layer':>5} {'mode':>9} {'rank':>5} {'recall':>7} {'prec':>7} {'pred.sp':>7} {'label.sp':>8} "
                 f"{'saved':>6} {'out.err':>8} {'params':>7}  MLP at target: rank recall prec pred.sp / note")
    for i, e in enumerate(pset.entries):
        s = e.stats
        if s.get("kind") == "moe":
            lines.append(f"{i:>5} {'moe':>9}")
            continue
        err = s.get("output_error")
        used = e.use
        mlp = (f"{s.get('trained_rank', '-')} {_pct(s.get('recall'))} {_pct(s.get('precision'))} "
               f"{_pct(s.get('predicted_sparsity'))}" if not used else "")
        lines.append(f"{i:>5} {e.mode:>9} {s.get('rank', 0) if used else '-':>5} "
                     f"{_pct(s.get('recall')) if used else '-':>7} {_pct(s.get('precision')) if used else '-':>7} "
                     f"{_pct(s.get('predicted_sparsity')) if used else '-':>7} {_pct(s.get('label_sparsity')):>8} "
                     f"{_pct(s.get('saved_share')) if used else '-':>6} "
                     f"{f'{err:.1e}' if used and err is not None else '-':>8} {e.param_count:>7}  "
                     f"{mlp}{' / ' + s['reason'] if s.get('reason') else ''}")
    for i, e in sorted(pset.experts.items()):
        s = e.stats
        lines.append(f"experts {i}->{i + 1}: free guess top-k recall {s.get('free_guess_recall', 0):.3f}"
                     + (f", trained rank {e.predictor.rank}: {s.get('recall', 0):.3f}" if e.mode == "predictor" else ""))
    modes = {mode: [i for i, e in enumerate(pset.entries) if e.mode == mode] for mode in ("predictor", "gate")}
    model = m.get("model_param_count") or 0
    share = f" = {pset.param_count / model:.2%} of the model" if model else ""
    trained = sum(e.stats.get("trained_param_count", 0) for e in pset.entries)
    lines.append(f"mode predictor in {len(modes['predictor'])} layers {modes['predictor']}, mode gate in "
                 f"{len(modes['gate'])} layers {modes['gate']}; held by the runtime: {pset.param_count} params{share}; "
                 f"all MLPs trained at the target: {trained}{f' = {trained / model:.2%}' if model else ''}")
    q = m.get("quality")
    if q:
        d, o, g = q["dense"], q["exact_path"], q["gated"]
        lines.append(f"held-out perplexity: dense {d['perplexity']:.3f}; exact path {o['perplexity']:.3f} "
                     f"({q['exact_path_increase']:+.2%}, agreement {o['agreement']:.3f}, down rows {o['down_fraction']:.1%}); "
                     f"with predictors {g['perplexity']:.3f} ({q['gated_increase']:+.2%}, agreement {g['agreement']:.3f}, "
                     f"gate+up rows {g['gate_up_fraction']:.1%}, up rows {g['up_fraction']:.1%}, down rows "
                     f"{g['down_fraction']:.1%}); limit {q['limit']:+.2%}")
        if q.get("trials"):
            lines.append(f"end-to-end trials ({q['options_considered']} options, {q['options_used']} on): " + ", ".join(
                f"{t['options']} on {t['increase']:+.2%}" for t in q["trials"]))
    if m.get("timings_s"):
        lines.append("time: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in m["timings_s"].items())
                     + (f"; total {m['wall_s']:.1f} s" if m.get("wall_s") else ""))
    return "\n".join(lines)
