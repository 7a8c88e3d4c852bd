"""The fused step with GGUF rows in place (A: four-row kernels, blocks_dot.h / blocks_multi.h) against the
same step with Q4_0 / Q4_1 / Q8_0 rows interleaved eight at a time (B: blocks_x8.h, what the engine
builds), in one process: one model, two steps, each with its own KV cache holding the same history,
single-token steps and step_many(T) timed alternately (the order flipped every round).

    python -m bench.interleave_ab --plan profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0 --threads 2 --rounds 11
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.cli_errors import run_main
from tandem.core.errors import TandemError

TOKEN_COUNTS = (1, 2, 4, 8, 16)


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def build_pair(engine):
    """(A, B): a step built with every row in place, and the engine's own (interleaved) step."""
    import online.execution.fused_decode as fused
    b = engine.compiled_decode
    if b is None or not hasattr(b, "step_many"):
        raise TandemError(f"no fused decode step: {engine.decode_path_reason}")
    real = fused.interleave
    fused.interleave = lambda ref, lib: ref  # A: the descriptors as described, nothing repacked
    try:
        a = fused.FusedDecodeStep.build(engine.model, engine.executor, residual_ratio=b.residual_ratio)
    finally:
        fused.interleave = real
    return a, b


def measure(a, b, cfg, context: int, rounds: int) -> dict:
    """{T: {"A": [ms], "B": [ms]}} and whether both steps' logits agree on the argmax."""
    import torch

    from tandem.core.kv_cache import KVCache
    history = [(7 * i + 3) % cfg.vocab_size for i in range(context)]
    caches = {}
    for name, step in (("A", a), ("B", b)):
        caches[name] = KVCache(cfg, context + max(TOKEN_COUNTS) + 1)
        step.step_many(history, 0, caches[name])
    probe = [(11 * i + 5) % cfg.vocab_size for i in range(8)]
    same = torch.equal(a.step_many(probe, context, caches["A"]).argmax(-1), b.step_many(probe, context, caches["B"]).argmax(-1))
    out: dict = {"argmax_equal": same}
    for T in TOKEN_COUNTS:
        tokens = [(11 * i + 5) % cfg.vocab_size for i in range(T)]
        out[T] = {"A": [], "B": []}
        for r in range(rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                step, cache = (a if name == "A" else b), caches[name]
                call = (lambda: step(tokens[0], context, cache)) if T == 1 else (lambda: step.step_many(tokens, context, cache))
                out[T][name].append(_ms(call))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf", help="a .gguf file or alias")
    ap.add_argument("--plan", default=None, help="a plan folder (default: none, the model packed int4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--context", type=int, default=128, help="history tokens before the timed steps")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1 or args.context < 1:
        raise TandemError("--rounds, --threads and --context must be >= 1")
    from online import Engine
    kwargs = {"plan": args.plan} if args.plan else {"weight_format": "int4"}
    engine = Engine.load(args.model, threads=args.threads, **kwargs)
    a, b = build_pair(engine)
    res = measure(a, b, engine.model.cfg, args.context, args.rounds)
    sa, sb = statistics.median(res[1]["A"]), statistics.median(res[1]["B"])
    print(f"- command: `python -m bench.interleave_ab {' '.join(sys.argv[1:])}`; wall ms, medians of "
          f"{args.rounds} interleaved rounds; greedy tokens of 8 steps equal: {res['argmax_equal']}")
    print("\n| T | A in place ms | B interleaved ms | A / A single | B / B single | B / A |")
    print("|---|---|---|---|---|---|")
    for T in TOKEN_COUNTS:
        ma, mb = statistics.median(res[T]["A"]), statistics.median(res[T]["B"])
        print(f"| {T} | {ma:.2f} | {mb:.2f} | {ma / sa:.2f}x | {mb / sb:.2f}x | {mb / ma:.3f} |")


if __name__ == "__main__":
    run_main(main)  # a bad model, plan or argument: one line, exit 2
