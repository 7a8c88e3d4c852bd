"""GGUF blocks read in place (f16 scales, Q8 down rows) against the float32-scale formats: SmolLM2 decode
through the fused C step, interleaved A/B in one process.

Variants over the same plan and the same tokens (positions 0..N of one text, fresh cache per round):
- ``f32 scales, fp16 down``: the formats before native/blocks.h (every f16 scale widened to float32,
  Q4_0 minimum -8d stored), i.e. what main read;
- ``f16 scales, fp16 down``: GGUF's own scale bytes read in place (bit-identical logits);
- ``f16 scales, q8 down`` / ``q4 down``: the sparse down rows as Q8_0 / Q4_1 rows (f16 scales per 32)
  instead of fp16 (re-quantized: the GGUF down blocks run along n_ff).
Bytes/token: qkv + o + gate + output layer, plus up and down rows in proportion to the measured active
fraction (the fused step reads every gate row, up/down rows only of active neurons; on layers with a
predictor gate rows too are counted at the active fraction: a lower bound, predictors mark more rows).

    python -m bench.gguf_blocks_ab --rounds 7 --tokens 64
    python -m bench.gguf_blocks_ab --model M.gguf --plan DIR --predictors DIR --downs fp16 int8b int4
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import numpy as np

PLAN = "profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0"
TEXT = ("Write a short story about a robot who learns to paint. Once upon a time there was a robot named "
        "Echo who lived in a small town by the sea. Every morning Echo would walk along the beach and watch "
        "the waves roll in, and every evening it tried to paint what it had seen.")


def float_scale_twin(w):
    """The same weights with float32 scales (the formats the kernels read before blocks.h)."""
    from online.kernels.quantize import BlockInt8Weight, Int4Weight
    from online.kernels.superblocks import Q4KWeight
    if isinstance(w, BlockInt8Weight) and w.scale.dtype == np.float16:
        return BlockInt8Weight(q=w.q, scale=w.scale.astype(np.float32))
    if isinstance(w, (Int4Weight, Q4KWeight)) and (isinstance(w, Q4KWeight) or w.scale.dtype == np.float16
                                                   or w.minimum is None):
        scale, minimum = w.float_scales()
        return Int4Weight(packed=w.packed, scale=scale, minimum=minimum, group_size=32)
    return w


@contextmanager
def float_scales_described():
    import online.execution.fused_decode as fd
    original = fd.describe
    fd.describe = lambda w, dot_input=True: original(float_scale_twin(w), dot_input)
    try:
        yield
    finally:
        fd.describe = original


def bytes_per_token(engine, active: float) -> float:
    ex, total = engine.executor, 0.0
    for i, block in enumerate(engine.model.layers):
        attn, ffn = block.self_attn, ex.splits[i].cpu
        total += attn.qkv_proj.linear.weight.nbytes + attn.o_proj.linear.weight.nbytes
        gate = ffn.gate.nbytes if ffn.gate is not None else 0
        total += gate * (active if ex.splits[i].predictor is not None else 1.0) + active * (ffn.up.nbytes + ffn.down_t.nbytes)
    return total + ex.head.weight.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--plan", default=PLAN)
    ap.add_argument("--predictors", default=None)
    ap.add_argument("--downs", nargs="+", default=["fp16", "int8b", "int4"], choices=("fp16", "int8b", "int4"))
    args = ap.parse_args()
    from online import Engine
    from online.execution.fused_decode import FusedDecodeStep

    downs = ["fp16"] + [d for d in args.downs if d != "fp16"]
    engines = {down: Engine.load(args.model, plan=args.plan, predictors=args.predictors, threads=args.threads,
                                 down_format=down) for down in downs}
    with float_scales_described():
        before = FusedDecodeStep.build(engines["fp16"].model, engines["fp16"].executor)
    label = {"fp16": "fp16 down", "int8b": "q8 down", "int4": "q4 down"}
    variants = {"f32 scales, fp16 down": (engines["fp16"], before)}
    variants.update({f"f16 scales, {label[d]}": (engines[d], engines[d].compiled_decode) for d in downs})
    try:
        ids = engines["fp16"].encode_prompt(TEXT)[: args.tokens]
    except Exception:  # noqa: BLE001 - a synthetic GGUF may carry no usable tokenizer
        ids = list(range(100, 100 + args.tokens))
    times = {k: [] for k in variants}  # tok/s per round
    ratios = {k: [] for k in variants}  # per round: this variant's time / the f32-scale variant's
    logits, active = {}, {}
    for r in range(args.rounds + 1):  # round 0: warm-up
        caches = {name: eng._kv_cache(len(ids) + 8) for name, (eng, _) in variants.items()}
        spent = dict.fromkeys(variants, 0.0)
        counts = {name: (eng.executor.counters.ffn_neurons_active, eng.executor.counters.ffn_neurons_total)
                  for name, (eng, _) in variants.items()}
        for pos, t in enumerate(ids):  # token-level interleaving: contention hits every variant alike
            for name, (eng, step) in variants.items():
                t0 = time.perf_counter()
                logits[name] = step(t, pos, caches[name])
                spent[name] += time.perf_counter() - t0
        for name, (eng, _) in variants.items():
            c = eng.executor.counters
            a0, n0 = counts[name]
            active[name] = (c.ffn_neurons_active - a0) / max(c.ffn_neurons_total - n0, 1)
            if r:
                times[name].append(len(ids) / spent[name])
                ratios[name].append(spent["f32 scales, fp16 down"] / spent[name])
    print(f"| variant | decode tok/s (median of {args.rounds} rounds) | speed vs f32 scales (median of per-round ratios) "
          "| MB/token | max |logit diff| vs f32 scales |")
    print("|---|---|---|---|---|")
    for name, (eng, _) in variants.items():
        med = statistics.median(times[name])
        diff = float((logits[name] - logits["f32 scales, fp16 down"]).abs().max())
        mb = (twin_bytes_per_token if name.startswith("f32") else bytes_per_token)(eng, active[name]) / 1e6
        print(f"| {name} | {med:.1f} [{min(times[name]):.1f}-{max(times[name]):.1f}] | {statistics.median(ratios[name]):.3f}x | {mb:.1f} | {diff:.3g} |")


def twin_bytes_per_token(engine, active: float) -> float:
    ex, total = engine.executor, 0.0
    for i, block in enumerate(engine.model.layers):
        attn, ffn = block.self_attn, ex.splits[i].cpu
        total += float_scale_twin(attn.qkv_proj.linear.weight).nbytes + float_scale_twin(attn.o_proj.linear.weight).nbytes
        gate = float_scale_twin(ffn.gate).nbytes if ffn.gate is not None else 0
        total += gate * (active if ex.splits[i].predictor is not None else 1.0)
        total += active * (float_scale_twin(ffn.up).nbytes + ffn.down_t.nbytes)
    return total + float_scale_twin(ex.head.weight).nbytes


if __name__ == "__main__":
    main()
