"""Cold start, inside one fresh process: import, Engine.load, the first and second request's TTFT.

Run from a checkout's root (its code is what gets imported), one process per repetition:

    .venv/bin/python bench/cold_start.py --plan profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0

Prints one JSON line: import_s, load_s, ttft_first_s, ttft_second_s, prompt_tokens.
"""
import argparse
import json
import os
import sys
import time

START = time.perf_counter()
sys.path.insert(0, os.getcwd())

PROMPT = ("Write a short note about the history of the city of Paris, its river, its bridges, "
          "and the people who live there today, in two or three sentences")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--plan", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from online import Engine
    imported = time.perf_counter()
    engine = Engine.load(args.model, plan=args.plan, threads=args.threads)
    loaded = time.perf_counter()
    first = engine.generate(PROMPT, max_new_tokens=1)
    second = engine.generate(PROMPT, max_new_tokens=1)
    print(json.dumps({"import_s": round(imported - START, 3), "load_s": round(loaded - imported, 3),
                      "ttft_first_s": first.stats["ttft_s"], "ttft_second_s": second.stats["ttft_s"],
                      "prompt_tokens": first.stats["prompt_tokens"]}))


if __name__ == "__main__":
    main()
