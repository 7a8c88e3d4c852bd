"""The multi-token fused step (``FusedDecodeStep.step_many``) against the single-token step on SmolLM2.

For T = 1, 2, 4, 8, 16 the time of one ``step_many`` call over T consecutive tokens (after a
``--context``-token history) is measured side by side with T single-token calls, in rounds
(median of ``--rounds``; also this thread's CPU time, the step's own work with ``--threads 1``); the ratio that matters is step_many(T) / single(1): what verifying T
drafted tokens costs in units of one decoded token. A second table times one decode step of 8
sequences over a paged pool (``step_batch``, continuous batching). Prints markdown tables;
``python -m bench.multi_token [--rounds 7] [--threads 2]``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time

TOKEN_COUNTS = (1, 2, 4, 8, 16)


def time_ms(fn) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) of one call: with --threads 1 the OpenMP region runs on this
    thread, so the CPU time is the step's own work, free of the scheduler's waits."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3


def measure(engine, context: int, rounds: int, counts=TOKEN_COUNTS) -> list[dict]:
    """Per T: median ms of one step_many call and of one single-token step (interleaved rounds)."""
    from tandem.core.kv_cache import KVCache
    step = engine.compiled_decode
    cache = KVCache(engine.model.cfg, context + max(counts) + 1)
    history = [(7 * i + 3) % engine.model.cfg.vocab_size for i in range(context)]
    step.step_many(history, 0, cache)
    rows = []
    for T in counts:
        tokens = [(11 * i + 5) % engine.model.cfg.vocab_size for i in range(T)]
        step.step_many(tokens, context, cache)  # warm-up
        multi, single = [], []
        for _ in range(rounds):  # interleaved, so that contention hits both alike
            multi.append(time_ms(lambda: step.step_many(tokens, context, cache)))
            single.append(time_ms(lambda: step(tokens[0], context, cache)))
        rows.append({"T": T, "multi_ms": statistics.median(m[0] for m in multi),
                     "single_ms": statistics.median(m[0] for m in single),
                     "multi_cpu_ms": statistics.median(m[1] for m in multi),
                     "single_cpu_ms": statistics.median(m[1] for m in single)})
    return rows


def measure_batch(engine, context: int, rounds: int, n_seqs: int = 8, block_tokens: int = 16) -> dict:
    """One decode step of ``n_seqs`` sequences (one token each, histories of different lengths, a
    paged pool with shuffled blocks) through ``step_batch`` vs one single-token step."""
    from types import SimpleNamespace

    import numpy as np

    from tandem.core.kv_cache import KVCache
    step, cfg = engine.compiled_decode, engine.model.cfg
    per_seq = (context + 8 * n_seqs) // block_tokens + 2
    storage = KVCache(cfg, per_seq * n_seqs * block_tokens)
    pool = SimpleNamespace(keys=storage.keys, values=storage.values, block_tokens=block_tokens)
    blocks = np.random.default_rng(0).permutation(per_seq * n_seqs).astype(np.int32)
    tables = [blocks[s * per_seq:(s + 1) * per_seq] for s in range(n_seqs)]
    lengths = [context + 8 * s for s in range(n_seqs)]
    for s, n in enumerate(lengths):  # the histories, 64 tokens per call
        ids = [(7 * i + 3 + s) % cfg.vocab_size for i in range(n)]
        for a in range(0, n, 64):
            step.step_batch(ids[a:a + 64], list(range(a, min(a + 64, n))), [tables[s]] * len(ids[a:a + 64]), pool,
                            [False] * len(ids[a:a + 64]))
    cache = KVCache(cfg, context + 1)
    step.step_many([(7 * i + 3) % cfg.vocab_size for i in range(context)], 0, cache)
    tokens = [(11 * s + 5) % cfg.vocab_size for s in range(n_seqs)]
    batch, single = [], []
    for _ in range(rounds):
        batch.append(time_ms(lambda: step.step_batch(tokens, lengths, tables, pool)))
        single.append(time_ms(lambda: step(tokens[0], context, cache)))
    return {"n": n_seqs, "batch_ms": statistics.median(b[0] for b in batch),
            "single_ms": statistics.median(b[0] for b in single),
            "batch_cpu_ms": statistics.median(b[1] for b in batch),
            "single_cpu_ms": statistics.median(b[1] for b in single)}


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
    print("\n| T | step_many ms | single step ms | step_many / single | ms per token "
          "| CPU ms step_many / single (this thread) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['multi_ms']:.2f} | {r['single_ms']:.2f} | {r['multi_ms'] / r['single_ms']:.2f}x "
              f"| {r['multi_ms'] / r['T']:.2f} | {r['multi_cpu_ms']:.2f} / {r['single_cpu_ms']:.2f} |")
    b = measure_batch(engine, args.context, args.rounds)
    print(f"\n| decode step | step_batch ms | single step ms | step_batch / single | CPU ms step_batch / single |")
    print("|---|---|---|---|---|")
    print(f"| {b['n']} sequences x 1 token (block_tokens 16) | {b['batch_ms']:.2f} | {b['single_ms']:.2f} "
          f"| {b['batch_ms'] / b['single_ms']:.2f}x | {b['batch_cpu_ms']:.2f} / {b['single_cpu_ms']:.2f} |")


if __name__ == "__main__":
    main()
