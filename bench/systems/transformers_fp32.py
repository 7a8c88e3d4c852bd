"""transformers float32 on the same GGUF, manual KV-cache greedy loop."""
from __future__ import annotations

import time

import torch

from bench.prompt import BENCH_PROMPT
from bench.systems.common import emit, timing_arguments


def main() -> None:
    ap = timing_arguments(__doc__)
    ap.add_argument("--gguf", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([tok(BENCH_PROMPT, add_special_tokens=False).input_ids])
    prefill, decode = [], []
    with torch.inference_mode():
        for run in range(args.runs + 1):
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            t1 = time.perf_counter()
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            t2 = time.perf_counter()
            for _ in range(args.decode_tokens - 1):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            t3 = time.perf_counter()
            if run == 0:
                continue  # warm-up
            prefill.append(ids.shape[1] / (t1 - t0))
            decode.append((args.decode_tokens - 1) / (t3 - t2))
    emit({"system": "transformers-fp32", "prompt_tokens": ids.shape[1], "decode_tokens": args.decode_tokens,
          "prefill_tok_s": prefill, "decode_tok_s": decode})


if __name__ == "__main__":
    main()
