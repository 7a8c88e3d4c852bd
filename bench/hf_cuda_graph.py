"""The peer on the GPU: transformers with a static KV cache and torch.compile(mode="reduce-overhead")
(CUDA graphs), fp16, greedy, on the same GGUF (dequantized by transformers). Prints decode tok/s.

``python -m bench.hf_cuda_graph [--tokens 128]`` (CUDA only; needs the gguf package).
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    import torch
    from pathlib import Path
    from transformers import AutoModelForCausalLM
    path = Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float16).cuda()
    model.generation_config.cache_implementation = "static"  # generate compiles the forward itself (CUDA graphs):
    from transformers import CompileConfig                     # a hand-compiled forward trips its cache's reuse
    model.generation_config.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]], device="cuda")
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
        torch.cuda.synchronize()
        rates.append(args.tokens / (time.perf_counter() - t))
    print(f"transformers fp16 static cache + torch.compile reduce-overhead: {args.tokens} tokens, "
          f"tok/s per run (first compiles) {[round(r, 1) for r in rates]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
