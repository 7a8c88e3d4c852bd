"""Decode speed against context length: Tandem with a float16 and a float32 KV cache, and llama.cpp, on one GGUF.

Attention reads the whole KV cache every token, so at long contexts its bytes rival the weights' (SmolLM2-135M:
46 KB of float32 keys and values per token of context over 30 layers, 92 MB at 2,000 tokens, beside ~97 MB of
int4 weights). Tandem's two engines (``kv_cache_type`` f16 / f32, same plan) run in one process, alternating
round by round; llama.cpp (bench/peers/venv, its default float16 cache) decodes the same prompt ids in its own
process right after. Prompts: the benchmark prompt repeated to each length. Writes bench/long_context.md.

    python -m bench.long_context --plan profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0 --contexts 200 1000 1900
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.cli_errors import run_main
from bench.prompt import BENCH_PROMPT
from bench.run import PEER_PYTHON, machine_line
from tandem.core.errors import TandemError

LLAMA_CPP_CONTEXT = 2048  # n_ctx of bench/systems/llamacpp_decode.py


def prompt_of(tokenizer, n_tokens: int) -> list[int]:
    base = tokenizer.encode(BENCH_PROMPT)
    return (base * (n_tokens // len(base) + 1))[:n_tokens]


def tandem_rates(args) -> tuple[list[list[int]], dict]:
    """(the prompts, {kv type: [[decode tok/s per round] per prompt]}), the two engines alternating within each round."""
    from online import Engine

    fmt = None if args.plan else "int4"
    engines = {kv: Engine.load(args.model, threads=args.threads, plan=args.plan, weight_format=fmt, kv_cache_type=kv)
               for kv in ("f16", "f32")}
    prompts = [prompt_of(engines["f16"].tokenizer, n) for n in args.contexts]
    for engine in engines.values():
        if engine.decode_path != "fused":
            raise TandemError(f"{args.model} does not decode through the fused step ({engine.decode_path_reason})")
        engine.generate(prompts[0], max_new_tokens=8, ignore_eos=True)  # warm-up
    rates = {kv: [[] for _ in prompts] for kv in engines}
    for r in range(args.runs):
        for i, ids in enumerate(prompts):
            for kv, engine in (engines.items() if r % 2 == 0 else reversed(engines.items())):
                out = engine.generate(ids, max_new_tokens=args.decode_tokens, ignore_eos=True)
                rates[kv][i].append(float(out.stats["decode_tokens_per_s"]))
        print(f"round {r + 1}/{args.runs} ({time.strftime('%H:%M:%S')})", flush=True)
    return prompts, rates


def llama_cpp_rates(args, gguf: str, prompts: list[list[int]]) -> list[list[float]] | None:
    if not PEER_PYTHON.exists():
        print("llama.cpp skipped: no bench/peers/venv (bench/build_peers.sh builds it)")
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = [str(PEER_PYTHON), "bench/systems/llamacpp_decode.py", "--gguf", gguf, "--prompt-ids", f.name,
           "--decode-tokens", str(args.decode_tokens + 1), "--runs", str(args.runs), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    record = json.loads([line for line in out.splitlines() if line.startswith("BENCH_JSON ")][-1][11:])
    Path(f.name).unlink()
    return [p["decode_tok_s"] for p in record["prompts"]]


def table(args, prompts, rates: dict, peer) -> list[str]:
    med = statistics.median
    lines = ["## Decode against context length: float16 vs float32 KV cache, and llama.cpp (`bench/long_context.py`)", "",
             f"- {machine_line()}; threads: {args.threads}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- Command: `python -m bench.long_context --plan {args.plan} --contexts {' '.join(map(str, args.contexts))} "
             f"--runs {args.runs} --decode-tokens {args.decode_tokens}`; decode tok/s = median of {args.runs} runs of "
             f"{args.decode_tokens} greedy tokens after the prompt (the benchmark prompt repeated); Tandem's two caches "
             "alternate in one process, llama.cpp (float16 cache, its default) runs right after in its own. The ratio "
             "column is the median of each run's f16 / f32 pair (runs minutes apart drift by more than the pairs do), "
             "not the ratio of the two medians.",
             "", "| context tokens | Tandem f16 KV | Tandem f32 KV | f16 / f32 (median of per-run ratios) | llama.cpp | "
             "Tandem f16 / llama.cpp |", "|---|---|---|---|---|---|"]
    for i, ids in enumerate(prompts):
        half, full = rates["f16"][i], rates["f32"][i]
        ratio = med(a / b for a, b in zip(half, full))
        lc = f"{med(peer[i]):.1f}" if peer else "n/a"
        vs = f"{med(half) / med(peer[i]):.2f}x" if peer else "n/a"
        lines.append(f"| {len(ids)} | {med(half):.1f} | {med(full):.1f} | {ratio:.3f} | {lc} | {vs} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--plan", default=None, help="plan directory (default: int4 weights, no plan)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 1000, 1900])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/long_context.md")
    args = ap.parse_args()
    if min(args.contexts) < 1 or max(args.contexts) + args.decode_tokens + 1 > LLAMA_CPP_CONTEXT:
        raise TandemError(f"contexts must lie in 1..{LLAMA_CPP_CONTEXT - args.decode_tokens - 1} "
                          f"(llama.cpp runs with n_ctx {LLAMA_CPP_CONTEXT})")
    from tandem.core.loading.resolve import resolve_model_path

    gguf = str(resolve_model_path(args.model))
    prompts, rates = tandem_rates(args)
    peer = llama_cpp_rates(args, gguf, prompts)
    lines = table(args, prompts, rates, peer)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    run_main(main)
