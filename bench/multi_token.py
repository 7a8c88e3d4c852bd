"""The multi-token fused step (``FusedDecodeStep.step_many``) against the single-token step on SmolLM2.

For T = 1, 2, 4, 8, 16 the time of one ``step_many`` call over T consecutive tokens (after a
``--context``-token history) is measured side by side with T single-token calls, in rounds
(median of ``--rounds``); the ratio that matters is step_many(T) / single(1): what verifying T
drafted tokens costs in units of one decoded token. Prints a markdown table;
``python -m bench.multi_token [--rounds 7] [--threads 2]``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time

TOKEN_COUNTS = (1, 2, 4, 8, 16)


def time_ms(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(engine, context: int, rounds: int, counts=TOKEN_COUNTS) -> list[dict]:
    """Per T: median ms of one step_many call and of one single-token step (interleaved rounds)."""
    from online.kv_cache import KVCache
    step = engine.compiled_decode
    cache = KVCache(engine.model.cfg, context + max(counts) + 1)
    history = [(7 * i + 3) % engine.model.cfg.vocab_size for i in range(context)]
    step.step_many(history, 0, cache)
    rows = []
    for T in counts:
        tokens = [(11 * i + 5) % engine.model.cfg.vocab_size for i in range(T)]
        multi, single = [], []
        for _ in range(rounds):  # interleaved, so that contention hits both alike
            multi.append(time_ms(lambda: step.step_many(tokens, context, cache), 1))
            single.append(time_ms(lambda: step(tokens[0], context, cache), 1))
        rows.append({"T": T, "multi_ms": statistics.median(multi), "single_ms": statistics.median(single)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--context", type=int, default=128, help="history tokens before the timed steps")
    args = ap.parse_args()
    from online import Engine
    engine = Engine.load("smollm2", threads=args.threads, weight_format="int4")
    if engine.compiled_decode is None:
        raise SystemExit(f"no fused decode step: {engine.decode_path_reason}")
    rows = measure(engine, args.context, args.rounds)
    print(f"- Date: {dt.date.today().isoformat()}; threads: {args.threads}; command: `python -m bench.multi_token "
          f"--rounds {args.rounds} --context {args.context}`; median of {args.rounds} interleaved rounds.")
    print("\n| T | step_many ms | single step ms | step_many / single | ms per token |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['multi_ms']:.2f} | {r['single_ms']:.2f} | {r['multi_ms'] / r['single_ms']:.2f}x "
              f"| {r['multi_ms'] / r['T']:.2f} |")


if __name__ == "__main__":
    main()
