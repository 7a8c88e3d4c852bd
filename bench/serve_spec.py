"""Speculation inside the batching server: aggregate decode tok/s with ``serve --speculate`` off vs on,
for 1 and N concurrent requests, side by side in one run (the scheduler in-process, no HTTP), greedy.
Also counts outputs identical to the speculation-off run (must be all).

    .venv/bin/python -m bench.serve_spec --plan profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0 \\
        --clients 1 4 --modes off lookup auto --new-tokens 64 --repeats 3
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.speculative import WORKLOADS


def serve_all(engine, prompts: list[list[int]], new_tokens: int, mode: str, draft_tokens: int) -> tuple[list, float, dict]:
    from online.server.batch_config import BatchConfig
    from online.server.metrics import Metrics
    from online.server.scheduler import Scheduler
    from online.speculative import SpeculationConfig
    engine.default_speculation = None if mode == "off" else SpeculationConfig(mode, draft_tokens)

    async def main():
        sched = Scheduler(engine, max_queue=64, request_timeout_s=600.0, metrics=Metrics(), batch=BatchConfig())
        sched.start()
        loop = asyncio.get_running_loop()

        async def one(ids):
            job = sched.submit(ids, new_tokens, {"temperature": 0.0, "ignore_eos": True}, stream_pieces=False, loop=loop)
            while True:
                kind, value = await job.events.get()
                if kind == "done":
                    return value
                if kind == "error":
                    raise RuntimeError(value.message)
        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await loop.run_in_executor(None, sched.close)
        return results, time.perf_counter() - t0, sched.loop.spec.describe()
    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--plan", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--modes", nargs="+", default=["off", "lookup", "auto"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-tokens", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from online import Engine
    engine = Engine.load(args.model, threads=args.threads, plan=args.plan)
    print(f"decode path {engine.decode_path}; plan {args.plan}; {args.new_tokens} new tokens; greedy; "
          f"medians of {args.repeats}")
    print("| workload | clients | mode | tok/s (wall incl. prefill) | vs off | per-request decode tok/s | vs off | acceptance | verify steps | identical to off |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload, texts in WORKLOADS.items():
        ids = [engine.encode_prompt([{"role": "user", "content": t}]) for t in texts]
        for clients in args.clients:
            prompts = [ids[i % len(ids)] for i in range(clients)]
            base, rows = None, {}
            for _ in range(args.repeats):  # modes interleaved per repeat: side by side under the same load
                for mode in args.modes:
                    results, wall_s, spec = serve_all(engine, prompts, args.new_tokens, mode, args.draft_tokens)
                    rate = sum(len(r.token_ids) for r in results) / wall_s
                    row = rows.setdefault(mode, {"rates": [], "decode": [], "spec": spec,
                                                 "tokens": [r.token_ids for r in results]})
                    row["rates"].append(rate)
                    row["decode"].append(statistics.median(r.stats["decode_tokens_per_s"] for r in results))
                    row["spec"] = spec
            base = rows.get("off")
            for mode, row in rows.items():
                rate = statistics.median(row["rates"])
                vs = f"{rate / statistics.median(base['rates']):.2f}x" if base else "-"
                same = sum(a == b for a, b in zip(row["tokens"], base["tokens"])) if base else "-"
                spec = row["spec"]
                decode = statistics.median(row["decode"])
                dvs = f"{decode / statistics.median(base['decode']):.2f}x" if base else "-"
                print(f"| {workload} | {clients} | {mode} | {rate:.2f} | {vs} | {decode:.2f} | {dvs} | {spec.get('acceptance_rate', '-')} | "
                      f"{spec.get('verify_steps', '-')} | {same}/{clients} |", flush=True)


if __name__ == "__main__":
    main()
