"""llama.cpp through llama-cpp-python on the same GGUF (run with bench/peers/venv's python)."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.prompt import BENCH_PROMPT  # noqa: E402
from bench.systems.common import emit, timing_arguments  # noqa: E402


def main() -> None:
    ap = timing_arguments(__doc__)
    ap.add_argument("--gguf", required=True)
    args = ap.parse_args()
    import numpy as np
    from llama_cpp import Llama
    # logits_all: llm.scores holds every evaluated row (without it only some versions fill the last
    # row, and argmax over a stale row gives wrong tokens)
    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=1024,
                n_batch=512, logits_all=True, verbose=False)
    ids = llm.tokenize(BENCH_PROMPT.encode(), add_bos=False)
    prefill, decode = [], []
    for run in range(args.runs + 1):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t2 = time.perf_counter()
        for _ in range(args.decode_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t3 = time.perf_counter()
        if run == 0:
            continue
        prefill.append(len(ids) / (t1 - t0))
        decode.append((args.decode_tokens - 1) / (t3 - t2))
    emit({"system": "llama.cpp", "prompt_tokens": len(ids), "decode_tokens": args.decode_tokens,
          "prefill_tok_s": prefill, "decode_tok_s": decode})


if __name__ == "__main__":
    main()
