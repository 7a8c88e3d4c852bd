"""Quality of each execution mode on held-out text: perplexity and next-token agreement with dense.

Held-out text = the calibration corpus's held-out documents (never used to pick thresholds).
Prints one BENCH_JSON line per mode.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from bench.systems.common import emit


def held_out_windows(engine, window_tokens: int) -> list[list[int]]:
    from offline.calibration import build_calibration_set
    calib = build_calibration_set(engine)
    windows = []
    for doc in calib.held_out:
        windows += [doc[i: i + window_tokens] for i in range(0, len(doc), window_tokens) if len(doc[i: i + window_tokens]) > 1]
    return windows


def score(engine, windows, decode_steps: bool = False) -> tuple[float, list[torch.Tensor]]:
    """Perplexity and per-position argmax; ``decode_steps``: token by token through the decode path
    generation uses (the fused C step), else batched prefill through the modules."""
    nll, count, argmaxes = 0.0, 0, []
    for w in windows:
        logits = engine.step_logits(w) if decode_steps else engine.logits(w)  # [T, vocab]
        nll += float(F.cross_entropy(logits[:-1].double(), torch.tensor(w[1:]), reduction="sum"))
        count += len(w) - 1
        argmaxes.append(logits[:-1].argmax(-1))
    return math.exp(nll / count), argmaxes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--window", type=int, default=256)
    args = ap.parse_args()
    from online import Engine
    # (name, engine arguments, score through decode steps)
    modes = [("dense fp32", {}, False), ("int8, all neurons", {"weight_format": "int8"}, False),
             ("int4, all neurons", {"weight_format": "int4"}, False),
             ("int4, all neurons, fused decode steps", {"weight_format": "int4"}, True)]
    if args.plan:
        modes += [("plan, int8, sparse", {"plan": args.plan, "weight_format": "int8"}, False),
                  ("plan, int8, sparse, fused decode steps", {"plan": args.plan, "weight_format": "int8"}, True),
                  ("plan, int4, sparse", {"plan": args.plan, "weight_format": "int4"}, False),
                  ("plan, int4, sparse, fused decode steps", {"plan": args.plan, "weight_format": "int4"}, True)]
    reference = None
    for name, kwargs, decode_steps in modes:
        engine = Engine.load(args.model, threads=args.threads, **kwargs)
        windows = held_out_windows(engine, args.window)
        ppl, argmaxes = score(engine, windows, decode_steps)
        if reference is None:
            reference = (ppl, argmaxes)
        agree = torch.cat([a == b for a, b in zip(argmaxes, reference[1])]).float().mean().item()
        stats = engine.generate([1, 2], max_new_tokens=1).stats
        emit({"system": name, "decode_path": engine.decode_path if decode_steps else "prefill", "perplexity": ppl, "perplexity_increase": ppl / reference[0] - 1,
              "top1_agreement_with_dense": agree, "tokens": sum(len(w) - 1 for w in windows),
              "weight_bytes_per_token": engine.weight_bytes_per_token, "ffn_sparsity_probe": stats.get("ffn_sparsity")})
        del engine


if __name__ == "__main__":
    main()
