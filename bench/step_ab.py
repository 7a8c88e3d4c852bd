"""Decode tok/s of one plan's fused step with this checkout's C kernels against the kernels at a git ref,
in one process: the same engine, KV cache and tokens, the library swapped between rounds (the order
flipped every round). On a shared host whose memory bandwidth drifts by tens of percent between
minutes, the per-round ratio is the figure that survives; separate runs are not comparable.

    python -m bench.step_ab --model bench/synthetic-models/llama-1b-synthetic-s90.Q4_0.gguf \\
        --plan bench/synthetic-models/llama-1b-synthetic-s90.Q4_0/plan --ref main --rounds 12
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.native_ab import baseline_library, use_library
from bench.cli_errors import run_main
from tandem.core.errors import TandemError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--plan", default=None, help="a plan folder (default: none, the model packed int4)")
    ap.add_argument("--predictors", default=None, help="predictor folder (default: the plan's own, if any)")
    ap.add_argument("--ref", default="main", help="git ref of the baseline kernels (A); B = this checkout")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per library per round")
    ap.add_argument("--context", type=int, default=24, help="prompt tokens before the timed steps")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from online import Engine
    from tandem.core.generate import prefill

    kwargs = {"plan": args.plan, "predictors": args.predictors} if args.plan else {"weight_format": "int4"}
    engine = Engine.load(args.model, threads=args.threads, **kwargs)
    step = engine.compiled_decode  # built on first use
    if step is None:
        raise TandemError(f"no fused decode step: {engine.decode_path_reason}")
    libs = {"A": baseline_library(args.ref), "B": step.native}
    text = "The history of the city begins with a small settlement on the river, where traders met. " * 64
    ids = engine.tokenizer.encode(text)[:args.context]
    cache = engine._kv_cache(len(ids) + args.tokens + 1)
    first = int(prefill(engine.model, engine.executor, cache, ids, compiled=step).argmax())
    rates: dict[str, list[float]] = {"A": [], "B": []}
    try:
        for r in range(args.rounds + 1):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                use_library(step, libs[name])
                tok, t0 = first, time.perf_counter()
                for i in range(args.tokens):  # rewrites the same cache rows every round
                    tok = int(step(tok, len(ids) + i, cache).argmax())
                if r:  # round 0 warms both libraries up
                    rates[name].append(args.tokens / (time.perf_counter() - t0))
    finally:
        use_library(step, libs["B"])
    ratios = [b / a for a, b in zip(rates["A"], rates["B"])]
    print(f"A = kernels at {args.ref}, B = this checkout; {args.rounds} rounds of {args.tokens} greedy tokens after "
          f"{len(ids)} prompt tokens, {args.threads} threads")
    print(f"A {statistics.median(rates['A']):.1f} tok/s, B {statistics.median(rates['B']):.1f} tok/s (medians); "
          f"B/A per round: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    run_main(main)  # a bad model, plan or argument: one line, exit 2
