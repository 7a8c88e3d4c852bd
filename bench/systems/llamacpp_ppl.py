"""llama.cpp perplexity over given token windows (run with bench/peers/venv's python).

Reads a JSON list of token-id windows; prints one BENCH_JSON line with the perplexity over all of them
(each window scored from its first token, as ``bench/gemma3_bench.py`` scores Tandem).
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.systems.common import emit, timing_arguments  # noqa: E402


def main() -> None:
    ap = timing_arguments(__doc__)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--windows", required=True, help="JSON file: list of token-id lists")
    args = ap.parse_args()
    import numpy as np
    from llama_cpp import Llama
    windows = json.load(open(args.windows))
    n_ctx = max(len(w) for w in windows) + 8
    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=n_ctx,
                n_batch=n_ctx, logits_all=True, verbose=False)
    nll, count = 0.0, 0
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[: len(w) - 1], dtype=np.float64)  # [T-1, vocab]
        top = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        nll += float((logz - logits[np.arange(len(w) - 1), w[1:]]).sum())
        count += len(w) - 1
    emit({"system": "llama.cpp", "perplexity": math.exp(nll / count), "scored_tokens": count})


if __name__ == "__main__":
    main()
