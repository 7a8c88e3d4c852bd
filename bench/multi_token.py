"""The multi-token fused step (``FusedDecodeStep.step_many``) against the single-token step on SmolLM2.

For T = 1, 2, 4, 8, 16 the time of one ``step_many`` call over T consecutive tokens (after a
``--context``-token history) is measured side by side with T single-token calls, in rounds
(median of ``--rounds``; also this thread's CPU time, the step's own work with ``--threads 1``); the ratio that matters is step_many(T) / single(1): what verifying T
drafted tokens costs in units of one decoded token. A second table times one decode step of 8
sequences over a paged pool (``step_batch``, continuous batching). Prints markdown tables;
``python -m bench.multi_token [--rounds 7] [--threads 2]``; ``--plan DIR --model M.gguf`` for a plan's weights,
``--baseline-ref main`` for an A/B of the C kernels at that git ref against this checkout's (bench/native_ab.py).
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


def batch_fixture(engine, context: int, n_seqs: int = 8, block_tokens: int = 16):
    """A paged pool holding ``n_seqs`` histories of different lengths (context, context + 8, ...) in
    shuffled blocks, and a contiguous cache with a ``context``-token history, both of the engine's KV type
    (float16 unless it says f32, as the server's pool; before 2026-11-29 both were float32). Returns (decode
    step of the batch, single-token step): two no-argument callables."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from tandem.core.kv_cache import KVCache
    step, cfg = engine.compiled_decode, engine.model.cfg
    dtype = torch.float32 if engine.kv_cache_type == "f32" else torch.float16
    per_seq = (context + 8 * n_seqs) // block_tokens + 2
    storage = KVCache(cfg, per_seq * n_seqs * block_tokens, dtype=dtype)
    pool = SimpleNamespace(keys=storage.keys, values=storage.values, block_tokens=block_tokens)
    blocks = np.random.default_rng(0).permutation(per_seq * n_seqs).astype(np.int32)
    tables = [blocks[s * per_seq:(s + 1) * per_seq] for s in range(n_seqs)]
    lengths = [context + 8 * s for s in range(n_seqs)]
    for s, n in enumerate(lengths):  # the histories, 64 tokens per call
        ids = [(7 * i + 3 + s) % cfg.vocab_size for i in range(n)]
        for a in range(0, n, 64):
            step.step_batch(ids[a:a + 64], list(range(a, min(a + 64, n))), [tables[s]] * len(ids[a:a + 64]), pool,
                            [False] * len(ids[a:a + 64]))
    cache = KVCache(cfg, context + 1, dtype=dtype)
    step.step_many([(7 * i + 3) % cfg.vocab_size for i in range(context)], 0, cache)
    tokens = [(11 * s + 5) % cfg.vocab_size for s in range(n_seqs)]
    return (lambda: step.step_batch(tokens, lengths, tables, pool)), (lambda: step(tokens[0], context, cache))


def measure_batch(engine, context: int, rounds: int, n_seqs: int = 8, block_tokens: int = 16) -> dict:
    """One decode step of ``n_seqs`` sequences (one token each, histories of different lengths, a
    paged pool with shuffled blocks) through ``step_batch`` vs one single-token step."""
    run_batch, run_single = batch_fixture(engine, context, n_seqs, block_tokens)
    batch, single = [], []
    for _ in range(rounds):
        batch.append(time_ms(run_batch))
        single.append(time_ms(run_single))
    return {"n": n_seqs, "batch_ms": statistics.median(b[0] for b in batch),
            "single_ms": statistics.median(b[0] for b in single),
            "batch_cpu_ms": statistics.median(b[1] for b in batch),
            "single_cpu_ms": statistics.median(b[1] for b in single)}


def measure_ab(engine, ref: str, context: int, rounds: int, counts=TOKEN_COUNTS) -> tuple[dict, dict]:
    """step_many(T) and the single step with the kernels of git ``ref`` (A) and of this checkout (B),
    interleaved in one process (bench/native_ab.py): ({T: {"A": [ms], "B": [ms]}}, single {"A", "B"})."""
    from bench.native_ab import baseline_library, interleaved_cpu_ms
    from tandem.core.kv_cache import KVCache
    step, vocab = engine.compiled_decode, engine.model.cfg.vocab_size
    libs = {"A": baseline_library(ref), "B": step.native}
    cache = KVCache(engine.model.cfg, context + max(counts) + 1)
    step.step_many([(7 * i + 3) % vocab for i in range(context)], 0, cache)
    rows, singles = {}, {"A": [], "B": []}
    for T in counts:
        tokens = [(11 * i + 5) % vocab for i in range(T)]
        step.step_many(tokens, context, cache)  # warm-up
        rows[T] = interleaved_cpu_ms(step, libs, lambda: step.step_many(tokens, context, cache), rounds)
        for k, v in interleaved_cpu_ms(step, libs, lambda: step(tokens[0], context, cache), rounds).items():
            singles[k] += v
    rows["batch"] = interleaved_cpu_ms(step, libs, batch_fixture(engine, context)[0], rounds, clock=time.perf_counter)
    return rows, singles


def print_ab(ref: str, rows: dict, singles: dict, context_note: str = "") -> None:
    sa, sb = min(singles["A"]), min(singles["B"])
    print(f"\nA = kernels at `{ref}`, B = this checkout; this thread's CPU ms, min (median) of the interleaved rounds; "
          f"single step A {sa:.2f} ({statistics.median(singles['A']):.2f}), B {sb:.2f} ({statistics.median(singles['B']):.2f})")
    print("\n| T | A step_many ms | B step_many ms | A / single | B / single | B / A |")
    print("|---|---|---|---|---|---|")
    batch = rows.pop("batch")
    for T, r in rows.items():
        a, b = min(r["A"]), min(r["B"])
        print(f"| {T} | {a:.2f} ({statistics.median(r['A']):.2f}) | {b:.2f} ({statistics.median(r['B']):.2f}) "
              f"| {a / sa:.2f}x | {b / sb:.2f}x | {b / a:.3f} |")
    a, b = statistics.median(batch["A"]), statistics.median(batch["B"])
    ratios = sorted(y / x for x, y in zip(batch["A"], batch["B"]))
    print(f"\n8 sequences x 1 token (`step_batch`, paged pool, histories {context_note}), wall ms, median of the "
          f"interleaved rounds: A {a:.2f}, B {b:.2f}; per-round B / A median {statistics.median(ratios):.3f} "
          f"(range {ratios[0]:.3f}-{ratios[-1]:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--context", type=int, default=128, help="history tokens before the timed steps")
    ap.add_argument("--model", default="smollm2", help="alias, .gguf or folder (default: smollm2, packed int4)")
    ap.add_argument("--plan", default=None, help="a plan folder (then the model's own weights, as planned)")
    ap.add_argument("--baseline-ref", default=None,
                    help="git ref whose C kernels run interleaved with this checkout's (A/B table, CPU time)")
    args = ap.parse_args()
    from online import Engine
    kwargs = {"plan": args.plan} if args.plan else {"weight_format": "int4"}
    engine = Engine.load(args.model, threads=args.threads, **kwargs)
    if engine.compiled_decode is None:
        raise SystemExit(f"no fused decode step: {engine.decode_path_reason}")
    if args.baseline_ref:
        print(f"- Date: {dt.date.today().isoformat()}; threads: {args.threads}; model {args.model}, plan {args.plan}; "
              f"{args.rounds} interleaved rounds")
        print_ab(args.baseline_ref, *measure_ab(engine, args.baseline_ref, args.context, args.rounds),
                 context_note=f"{args.context}..{args.context + 56} tokens")
        return
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
    print("\n| decode step | step_batch ms | single step ms | step_batch / single | CPU ms step_batch / single |")
    print("|---|---|---|---|---|")
    print(f"| {b['n']} sequences x 1 token (block_tokens 16) | {b['batch_ms']:.2f} | {b['single_ms']:.2f} "
          f"| {b['batch_ms'] / b['single_ms']:.2f}x | {b['batch_cpu_ms']:.2f} / {b['single_cpu_ms']:.2f} |")


if __name__ == "__main__":
    main()
