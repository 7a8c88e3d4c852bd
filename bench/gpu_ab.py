"""Plans against layer offload at the same budgets, A/B interleaved: every engine loaded once, then each
round decodes once on each (in a rotating order), so drift on a noisy host hits all of them alike.

``python -m bench.gpu_ab --plans .dev/plans --fractions 0.25,0.5 --rounds 9`` prints, per fraction, the
median tok/s of layer offload and of the plan and the median of the per-round plan / layer offload
ratios (with their range), beside CPU only. The budgets are bench.gpu_bench's (the plans' own).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.gpu_bench import CONTEXT_TOKENS, PROMPT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--profile", default="profiles/SmolLM2-135M-Instruct.Q4_1/profile")
    p.add_argument("--plans", required=True, help="bench.gpu_bench's --work folder (plan-<fraction> inside)")
    p.add_argument("--fractions", default="0.1,0.25,0.5")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=8)
    args = p.parse_args(argv)
    from online import Engine
    from placement.plan import read_plan
    engines = {"CPU only": Engine.load(args.model, layer_offload=True, gpu_budget_bytes=0, threads=args.threads,
                                       context_length=CONTEXT_TOKENS)}
    fractions = [f.strip() for f in args.fractions.split(",") if f.strip()]
    for f in fractions:
        plan_dir = Path(args.plans) / f"plan-{float(f):g}"
        budget = read_plan(plan_dir).gpu_budget_bytes
        engines[f"layer offload {f}"] = Engine.load(args.model, layer_offload=True, gpu_budget_bytes=budget,
                                                    threads=args.threads, context_length=CONTEXT_TOKENS)
        engines[f"plan {f}"] = Engine.load(args.model, plan=str(plan_dir), profile=args.profile, threads=args.threads)
    names = list(engines)
    for engine in engines.values():  # compile, capture, warm the caches
        engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out = engines[n].generate(PROMPT, max_new_tokens=args.tokens, ignore_eos=True)
            rates[n].append(out.stats["decode_tokens_per_s"])
    print(f"{args.rounds} rounds of {args.tokens} tokens, {args.threads} threads, medians (tok/s)")
    print(f"CPU only: {statistics.median(rates['CPU only']):.1f}")
    for f in fractions:
        lo, plan = rates[f"layer offload {f}"], rates[f"plan {f}"]
        ratios = sorted(a / b for a, b in zip(plan, lo))
        print(f"{float(f):.0%}: layer offload {statistics.median(lo):.1f} ({engines[f'layer offload {f}'].decode_path}), "
              f"plan {statistics.median(plan):.1f} ({engines[f'plan {f}'].decode_path}); plan / layer offload per "
              f"round: median {statistics.median(ratios):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
