"""Tandem's engine: prefill and decode timings, repeated runs in one process."""
from __future__ import annotations

import time

from bench.prompt import BENCH_PROMPT
from bench.systems.common import emit, timing_arguments


def main() -> None:
    ap = timing_arguments(__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--plan", default=None)
    ap.add_argument("--weight-format", default=None)
    ap.add_argument("--name", default="tandem dense fp32")
    ap.add_argument("--no-fused-decode", action="store_true")
    ap.add_argument("--no-sparse", action="store_true")
    args = ap.parse_args()
    from online import Engine
    t0 = time.perf_counter()
    engine = Engine.load(args.model, threads=args.threads, plan=args.plan, weight_format=args.weight_format,
                         fused_decode=not args.no_fused_decode, sparse=not args.no_sparse)
    load_s = time.perf_counter() - t0
    prompt_ids = engine.tokenizer.encode(BENCH_PROMPT)
    engine.generate(prompt_ids, max_new_tokens=8, ignore_eos=True)  # warm-up
    prefill, decode = [], []
    for _ in range(args.runs):
        out = engine.generate(prompt_ids, max_new_tokens=args.decode_tokens, ignore_eos=True)
        prefill.append(out.stats["prefill_tokens_per_s"])
        decode.append(out.stats["decode_tokens_per_s"])
    emit({"system": args.name, "prompt_tokens": len(prompt_ids), "ffn_sparsity": out.stats.get("ffn_sparsity"),
          "decode_tokens": args.decode_tokens, "prefill_tok_s": prefill, "decode_tok_s": decode,
          "load_s": round(load_s, 2), "weight_bytes_per_token": engine.weight_bytes_per_token,
          "bytes_moved_per_token": out.stats.get("bytes_moved_per_token", 0), "decode_path": engine.decode_path})


if __name__ == "__main__":
    main()
