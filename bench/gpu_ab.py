"""Plans against layer offload at the same budgets, A/B interleaved: every engine loaded once, then each
round decodes once on each (in a rotating order), so drift on a noisy host hits all of them alike.

``python -m bench.gpu_ab --plans .dev/plans --fractions 0.25,0.5 --rounds 9`` prints, per fraction, the
median tok/s of layer offload and of the plan and the median of the per-round plan / layer offload
ratios (with their range), beside CPU only. The budgets are bench.gpu_bench's (the plans' own). Fraction
0 is a plan with no GPU budget (a sparse model's predictors on the CPU alone: what the GPU adds to it);
it has no layer-offload twin (that is CPU only). ``--out FILE`` also writes the table as markdown, with
each engine's decode path, link bytes, syncs and launches per token and the plan's modeled tok/s.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

from bench.gpu_bench import PROMPT, context_tokens


def load_engines(args, fractions: list[str]) -> tuple[dict, dict]:
    """{name: engine} and {name: modeled tok/s or None}, CPU only first."""
    from online import Engine
    from placement.plan import read_plan
    context = context_tokens(args.model)
    engines = {"CPU only": Engine.load(args.model, layer_offload=True, gpu_budget_bytes=0, threads=args.threads,
                                       context_length=context)}
    modeled = {"CPU only": None}
    for f in fractions:
        plan_dir = Path(args.plans) / f"plan-{float(f):g}"
        plan = read_plan(plan_dir)
        if float(f) > 0:
            engines[f"layer offload {f}"] = Engine.load(args.model, layer_offload=True,
                                                        gpu_budget_bytes=plan.gpu_budget_bytes, threads=args.threads,
                                                        context_length=context)
            modeled[f"layer offload {f}"] = plan.modeled.get("layer_offload_tokens_per_s")
        engines[f"plan {f}"] = Engine.load(args.model, plan=str(plan_dir), profile=args.profile,
                                           predictors=args.predictors, threads=args.threads)
        modeled[f"plan {f}"] = plan.modeled.get("tokens_per_s")
    return engines, modeled


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--profile", default="profiles/SmolLM2-135M-Instruct.Q4_1/profile")
    p.add_argument("--predictors", default=None, help="the predictors the plans were made with (when not beside them)")
    p.add_argument("--plans", default=None, help="bench.gpu_bench's --work folder (plan-<fraction> inside)")
    p.add_argument("--fractions", default="0.1,0.25,0.5")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--stage", default=None, help="a bench.gpu_sparse_stage folder: its model, profile, predictors, plans")
    args = p.parse_args(argv)
    if args.stage:
        import json
        stage = json.loads((Path(args.stage) / "stage.json").read_text())
        args.model, args.predictors = stage["model"], stage["predictors"]
        args.profile, args.plans = str(Path(args.stage) / "profile"), str(Path(args.stage) / "plans")
    if args.plans is None:
        p.error("--plans (or --stage) is required")
    fractions = [f.strip() for f in args.fractions.split(",") if f.strip()]
    engines, modeled = load_engines(args, fractions)
    names = list(engines)
    for engine in engines.values():  # compile, capture, warm the caches
        engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    rates: dict[str, list[float]] = {n: [] for n in names}
    stats: dict[str, dict] = {}
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out = engines[n].generate(PROMPT, max_new_tokens=args.tokens, ignore_eos=True)
            rates[n].append(out.stats["decode_tokens_per_s"])
            stats[n] = out.stats
    cpu_only = statistics.median(rates["CPU only"])
    lines = [f"{args.rounds} rounds of {args.tokens} tokens, {args.threads} threads, medians (tok/s)",
             f"CPU only: {cpu_only:.1f}"]
    for f in fractions:
        plan = rates[f"plan {f}"]
        if float(f) == 0:
            ratios = sorted(a / b for a, b in zip(plan, rates["CPU only"]))
            lines.append(f"0%: plan {statistics.median(plan):.1f} ({engines[f'plan {f}'].decode_path}); plan / CPU only "
                         f"(dense) per round: median {statistics.median(ratios):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}")
            continue
        lo = rates[f"layer offload {f}"]
        ratios = sorted(a / b for a, b in zip(plan, lo))
        lines.append(f"{float(f):.0%}: layer offload {statistics.median(lo):.1f} ({engines[f'layer offload {f}'].decode_path}), "
                     f"plan {statistics.median(plan):.1f} ({engines[f'plan {f}'].decode_path}); plan / layer offload per "
                     f"round: median {statistics.median(ratios):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}")
    print("\n".join(lines))
    if args.out:
        write_table(args, names, engines, rates, stats, modeled, lines, argv if argv is not None else sys.argv[1:])
    return 0


def write_table(args, names, engines, rates, stats, modeled, lines, argv: list[str]) -> None:
    import torch
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA: CPU tier, not GPU numbers"
    rows = ["| engine | median tok/s | modeled tok/s | decode path | link bytes/token | tier syncs/token "
            "| launches / graph replays per token | FFN sparsity |", "|---|---|---|---|---|---|---|---|"]
    for n in names:
        s, m = stats[n], modeled[n]
        rows.append(f"| {n} | {statistics.median(rates[n]):.1f} | {'-' if m is None else f'{m:.0f}'} | "
                    f"{engines[n].decode_path} | {s.get('link_bytes_per_token', 0)} | {s.get('tier_syncs_per_token', 0)} | "
                    f"{s.get('gpu_launches_per_token', 0)} / {s.get('graph_replays_per_token', 0)} | "
                    f"{s.get('ffn_sparsity', '-')} |")
    text = "\n".join([f"Device: {device}; host {platform.node()}. Model {args.model}; plans {args.plans}.",
                      f"Command: `python -m bench.gpu_ab {' '.join(argv)}`", "", "```", *lines, "```", "",
                      *rows]) + "\n"
    from tandem.core.artifacts import atomic_write_bytes
    atomic_write_bytes(args.out, text.encode())


if __name__ == "__main__":
    sys.exit(main())
