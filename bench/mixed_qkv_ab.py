"""A GGUF whose q/k and v blocks differ in kind (Gemma 3 270M Q4_K_M in an int4 plan: Q5_0 q/k read in
place, its Q8_0 v re-quantized to int4): decode through the fused step (q, k, v kept apart) against the
module path, interleaved A/B in one process over the same greedy generations.

Before SplitQKVModule such layers were left unstacked and the whole model decoded through the module
path; the ``modules`` column is what main ran.

    python -m bench.mixed_qkv_ab --rounds 5 --tokens 32
"""
from __future__ import annotations

import argparse
import statistics

MODEL = "models/gemma-3-270m-q4_k_m.gguf"
PROMPT = [2, 818, 5279, 529, 7001, 563, 496, 6064]


def main() -> None:
    from online.engine import Engine
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--weight-format", default="int4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    engines = {name: Engine.load(args.model, weight_format=args.weight_format, sparse=False, step_cache=False,
                                 fused_decode=name == "fused") for name in ("fused", "modules")}
    for name, e in engines.items():
        print(f"{name}: decode path {e.decode_path}, weight MB/token {e.weight_bytes_per_token / 1e6:.1f}")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    texts = {}
    for _ in range(args.rounds):
        for name, e in engines.items():  # interleaved: contention hits both alike
            out = e.generate(PROMPT, max_new_tokens=args.tokens, ignore_eos=True)
            rates[name].append(out.stats["decode_tokens_per_s"])
            texts[name] = out.token_ids
    for name, r in rates.items():
        print(f"{name}: decode tok/s median {statistics.median(r):.2f} of {[round(x, 2) for x in r]}")
    print(f"fused / modules: {statistics.median(rates['fused']) / statistics.median(rates['modules']):.2f}x; "
          f"greedy tokens equal: {texts['fused'] == texts['modules']}")


if __name__ == "__main__":
    main()
