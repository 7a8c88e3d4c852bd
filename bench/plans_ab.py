"""Decode tok/s of two plans of one model, alternated in one process (the order flipped every round):
e.g. the README's step-by-step plan with predictors against the `tandem prepare` plan (issue 13).

    python -m bench.plans_ab --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --plans profiles/SmolLM2-135M-Instruct.Q4_1/plan-cpu-pred profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.cli_errors import run_main
from tandem.core.errors import TandemError

PROMPT = [{"role": "user", "content": "Explain why the sky is blue to a ten-year-old."}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--plans", nargs=2, required=True, metavar=("A", "B"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=96, help="greedy tokens per generation")
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 1:
        raise TandemError("--rounds and --tokens must be >= 1")
    for plan in args.plans:
        if not (Path(plan) / "plan.json").is_file():
            raise TandemError(f"{plan}: not a plan folder (no plan.json)")
    from online import Engine
    engines = [Engine.load(args.model, plan=p, threads=args.threads) for p in args.plans]
    ids = engines[0].encode_prompt(PROMPT)
    rates: list[list[float]] = [[], []]
    outputs = [None, None]
    for e in engines:  # warm-up
        e.generate(ids, max_new_tokens=8, ignore_eos=True)
    for r in range(args.rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            out = engines[i].generate(ids, max_new_tokens=args.tokens, ignore_eos=True)
            rates[i].append(out.stats["decode_tokens_per_s"])
            outputs[i] = out.token_ids
    print(f"- command: `python -m bench.plans_ab {' '.join(sys.argv[1:])}`; decode tok/s, median [min-max] of "
          f"{args.rounds} alternating {args.tokens}-token greedy generations")
    print("\n| plan | decode path | decode tok/s | predictor layers |")
    print("|---|---|---|---|")
    for plan, e, r in zip(args.plans, engines, rates):
        step = e.compiled_decode
        pred = sum(1 for layer in step._layers if layer.pred) if step is not None and hasattr(step, "_layers") else 0
        print(f"| {plan} | {e.decode_path} | {statistics.median(r):.1f} [{min(r):.1f}-{max(r):.1f}] | {pred} |")
    if not all(x > 0 for r in rates for x in r):
        raise TandemError("a run decoded no tokens (no decode rate to compare); use more --tokens")
    ratio = statistics.median(a / b for a, b in zip(rates[0], rates[1]))
    print(f"\nA / B per round, median: {ratio:.3f}; greedy outputs equal: {outputs[0] == outputs[1]}")


if __name__ == "__main__":
    run_main(main)  # a bad model, plan or argument: one line, exit 2
