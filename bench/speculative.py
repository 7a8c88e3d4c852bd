"""Speculative decoding benchmark: plain fused decode vs each drafter (lookup, sparse, auto) and
llama.cpp, side by side in one run, on chat prompts and an input-grounded task, greedy.

Per mode and workload: decode tok/s (median over runs of the per-prompt median), acceptance,
tokens per verify step, draft time share, and how many outputs are identical to plain greedy
decoding (must be all). llama.cpp runs from bench/peers/venv when it exists (skipped otherwise).

    .venv/bin/python -m bench.speculative --plan profiles/SmolLM2-135M-Instruct.Q4_1/plan-... --runs 3
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.prompt import BENCH_PROMPT

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / "bench" / "peers" / "venv" / "bin" / "python"
PASSAGE = BENCH_PROMPT.split(" Write a short story")[0]
WORKLOADS = {
    "chat": ["What are three good habits for learning a new language?",
             "Explain why the sky is blue to a ten-year-old.",
             "Write a short poem about a cat watching the rain.",
             "Give me a simple recipe for vegetable soup."],
    "grounded": [f"Repeat the following passage word for word.\n\n{PASSAGE}",
                 f"Summarise this passage in a few sentences, quoting its key phrases.\n\n{PASSAGE}",
                 f"Rewrite this passage in the present tense, changing nothing else.\n\n{PASSAGE}"],
}
MODES = ("off", "lookup", "sparse", "auto")


def run_tandem(args) -> tuple[dict, dict]:
    from online import Engine
    engine = Engine.load(args.model, threads=args.threads, plan=args.plan, weight_format=args.weight_format)
    prompts = {w: [engine.encode_prompt([{"role": "user", "content": p}]) for p in ps] for w, ps in WORKLOADS.items()}
    results: dict = {}
    for workload, ids_list in prompts.items():
        reference = [engine.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True).token_ids for ids in ids_list]
        for mode in MODES:
            rates, stats_rows, identical, reason = [], [], 0, ""
            try:
                for i, ids in enumerate(ids_list):
                    per_run = []
                    for _ in range(args.runs):
                        out = engine.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True, speculate=mode,
                                              draft_tokens=args.draft_tokens if mode != "off" else None)
                        per_run.append(out.stats["decode_tokens_per_s"])
                    identical += out.token_ids == reference[i]
                    rates.append(statistics.median(per_run))
                    stats_rows.append(out.stats)
                    reason = out.stats.get("speculate_reason", reason)
            except Exception as exc:  # a drafter this engine cannot run: reported, not fatal
                results[(workload, mode)] = {"error": str(exc).splitlines()[0]}
                continue

            def mean(key):
                return round(statistics.mean(s.get(key, 0.0) for s in stats_rows), 3)
            results[(workload, mode)] = {"tok_s": round(statistics.median(rates), 2), "per_prompt_tok_s": rates,
                                         "acceptance": mean("acceptance_rate"),
                                         "tokens_per_verify": mean("tokens_per_verify_step"),
                                         "draft_share": mean("draft_time_share"),
                                         "identical": f"{identical}/{len(ids_list)}", "reason": reason}
    info = {"decode_path": engine.decode_path, "plan": str(args.plan), "draft_thresholds":
            getattr(engine.draft_thresholds_info, "source", None)}
    return results, {"prompts": prompts, **info}


def run_llamacpp(args, prompts: dict) -> dict:
    if not PEER_PYTHON.exists() or not str(args.model).endswith(".gguf"):
        return {}
    out = {}
    for workload, ids_list in prompts.items():
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(ids_list, f)
        cmd = [str(PEER_PYTHON), str(ROOT / "bench" / "systems" / "llamacpp_decode.py"), "--gguf", str(args.model),
               "--prompt-ids", f.name, "--decode-tokens", str(args.new_tokens), "--runs", str(args.runs),
               "--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")), None)
        if line is None:
            out[workload] = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
            continue
        rec = json.loads(line[len("BENCH_JSON "):])
        out[workload] = {"tok_s": round(statistics.median(statistics.median(p["decode_tok_s"]) for p in rec["prompts"]), 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--plan", default=None)
    ap.add_argument("--weight-format", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--draft-tokens", type=int, default=None)
    ap.add_argument("--label", default="", help="e.g. 'contended' (shown in the header)")
    args = ap.parse_args()
    if args.plan is None and args.weight_format is None:
        args.weight_format = "int4"
    t0 = time.time()
    results, info = run_tandem(args)
    peer = run_llamacpp(args, info["prompts"])
    print(f"## Speculative decoding {args.label}".rstrip())
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, {time.strftime('%Y-%m-%d')}, "
          f"{args.new_tokens} new tokens, greedy, median of {args.runs} runs per prompt; decode path "
          f"{info['decode_path']}, plan {info['plan']}, draft thresholds {info['draft_thresholds']}")
    print(f"command: {' '.join(sys.argv)}\n")
    print("| workload | mode | decode tok/s | vs off | vs llama.cpp | acceptance | tokens/verify | draft time | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for workload in WORKLOADS:
        base = results.get((workload, "off"), {}).get("tok_s")
        peer_tok = peer.get(workload, {}).get("tok_s")
        for mode in MODES:
            r = results[(workload, mode)]
            if "error" in r:
                print(f"| {workload} | {mode} | n/a: {r['error']} | | | | | | |")
                continue
            ratio = f"{r['tok_s'] / base:.2f}x" if base else ""
            vs_peer = f"{r['tok_s'] / peer_tok:.2f}x" if peer_tok else "n/a"
            print(f"| {workload} | {mode} | {r['tok_s']} | {ratio} | {vs_peer} | {r['acceptance']} | "
                  f"{r['tokens_per_verify']} | {r['draft_share']:.0%} | {r['identical']} |")
        if peer_tok:
            print(f"| {workload} | llama.cpp | {peer_tok} | | 1.00x | | | | |")
        elif workload in peer:
            print(f"| {workload} | llama.cpp | n/a: {peer[workload]['error']} | | | | | | |")
    if not peer:
        print("\nllama.cpp: skipped (no bench/peers/venv; `make bench-peers` builds it)")
    print(f"\n(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
