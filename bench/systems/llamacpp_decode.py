"""llama.cpp greedy decode of given prompt token ids (run with bench/peers/venv's python): decode tok/s.

    python bench/systems/llamacpp_decode.py --gguf M.gguf --prompt-ids ids.json --decode-tokens 96 --runs 3
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.systems.common import emit, timing_arguments  # noqa: E402


def main() -> None:
    ap = timing_arguments(__doc__)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompt-ids", required=True, help="JSON file: a list of prompts, each a list of token ids")
    args = ap.parse_args()
    import numpy as np
    from llama_cpp import Llama
    prompts = json.loads(open(args.prompt_ids).read())
    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048,
                n_batch=512, logits_all=True, verbose=False)
    records = []
    for ids in prompts:
        rates, tokens = [], []
        for _ in range(args.runs):
            llm.reset()
            llm.eval(ids)
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            tokens = [token]
            t0 = time.perf_counter()
            for _ in range(args.decode_tokens - 1):
                llm.eval([token])
                token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                tokens.append(token)
            rates.append((args.decode_tokens - 1) / (time.perf_counter() - t0))
        records.append({"decode_tok_s": rates, "token_ids": tokens})
    emit({"system": "llama.cpp", "prompts": records})


if __name__ == "__main__":
    main()
