"""CPU tier: the CPU kernels over the tier's codes (A) against dequantize-per-call + torch matmul (B).

One engine, one plan, rounds interleaved A/B/A/B in one process (so machine contention hits both
alike); prints the median decode tok/s of each and their ratio. Usage::

    python -m bench.tier_kernels_ab --plan /tmp/plan-rtx4090-64MiB --tokens 16 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys

PROMPT = "Write a short story about a robot who learns to paint. Once upon a time"


def tier_matrices(engine) -> list:
    """Every TierMatrix the engine holds, and every hot FFN part (which has a kernel FFN of its own)."""
    ex, mats, parts = engine.executor, [], []
    for split in ex.splits:
        if split is not None and split.gpu is not None:
            parts.append(split.gpu)
            mats += [m for m in (split.gpu.up, split.gpu.down_t, split.gpu.gate) if m is not None]
    for block in engine.model.layers:
        if getattr(block.self_attn, "on_tier", False):
            mats += block.self_attn.qkv_parts + [block.self_attn.o]
    if ex.tier_head is not None:
        mats.append(ex.tier_head)
    table = getattr(engine.model.embed_tokens, "table", None)
    if table is not None and table is not ex.tier_head:
        mats.append(table)
    return mats, parts


def set_kernels(engine, on: bool, saved: dict) -> None:
    """Switch the CPU-kernel reading of the tier on (A) or off (B: dequantize + matmul per call)."""
    mats, parts = tier_matrices(engine)
    for m in mats:
        if on:
            m._kernel = saved.get(id(m))
        else:
            saved[id(m)] = m.kernel()
            m._kernel = False
    for p in parts:
        if on:
            p.kernel_ffn = saved.get(("ffn", id(p)))
        else:
            saved[("ffn", id(p))] = p.kernel_ffn
            p.kernel_ffn = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--profile", default="profiles/SmolLM2-135M-Instruct.Q4_1/profile")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (1 on a contended machine: "
                    "spinning OpenMP barriers collapse when the cores are oversubscribed)")
    args = ap.parse_args(argv)
    from online import Engine
    engine = Engine.load(args.model, plan=args.plan, gpu_device="cpu", profile=args.profile, threads=args.threads)
    saved: dict = {}
    rates: dict[str, list[float]] = {"kernels": [], "dequantize": []}
    engine.generate(PROMPT, max_new_tokens=2, ignore_eos=True)  # JIT / first-call costs out of the rounds
    for _ in range(args.rounds):
        for name, on in (("kernels", True), ("dequantize", False)):
            set_kernels(engine, on, saved)
            out = engine.generate(PROMPT, max_new_tokens=args.tokens, ignore_eos=True)
            rates[name].append(out.stats["decode_tokens_per_s"])
            print(name, f"{rates[name][-1]:.2f} tok/s", out.stats.get("decode_path"), flush=True)
    a, b = statistics.median(rates["kernels"]), statistics.median(rates["dequantize"])
    print(f"median: kernels {a:.2f} tok/s, dequantize-per-call {b:.2f} tok/s, ratio {a / b:.2f}x "
          f"({args.rounds} interleaved rounds of {args.tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
