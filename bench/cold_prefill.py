"""First-request TTFT of a fresh process: prompt prefill through the module graph (C row kernels, torch matmuls) against the
fused step's batched call (Engine._step_prefill), A/B interleaved, one process per sample.

    .venv/bin/python -m bench.cold_prefill --plan profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0 --rounds 5

Prints the median first and second TTFT (ms) and the process wall time per mode, and whether both modes gave
the same greedy tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from online import Engine
from tandem.core.generate import prefill
if sys.argv[1] == "module":
    Engine._step_prefill = lambda self, ids, cache: prefill(self.model, self.executor, cache, ids)
engine = Engine.load(sys.argv[2], plan=sys.argv[3], threads=int(sys.argv[4]))
prompt = [{"role": "user", "content": sys.argv[5]}]
first = engine.generate(prompt, max_new_tokens=8)
second = engine.generate(prompt, max_new_tokens=8)
print(json.dumps({"ttft1_ms": 1000 * first.stats["ttft_s"], "ttft2_ms": 1000 * second.stats["ttft_s"],
                  "prompt_tokens": first.stats["prompt_tokens"], "tokens": first.token_ids,
                  "wall_s": time.perf_counter() - t0}))
"""
PROMPT = "Name three rivers in Europe, and say in one sentence which of them is the longest."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    rows: dict[str, list[dict]] = {"module": [], "step": []}
    for _ in range(args.rounds):
        for mode in rows:  # interleaved: both modes see the same machine load
            out = subprocess.run([sys.executable, "-c", CHILD, mode, args.model, args.plan, str(args.threads), PROMPT],
                                 capture_output=True, text=True, check=True)
            rows[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    stamp = time.strftime("%Y-%m-%d %H:%M")
    print(f"cold prefill A/B, {stamp}, {args.rounds} rounds, {rows['step'][0]['prompt_tokens']}-token chat prompt, "
          f"threads {args.threads}; medians")
    for mode, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("ttft1_ms", "ttft2_ms", "wall_s")}
        print(f"  {mode:6s}: first TTFT {med['ttft1_ms']:.0f} ms, second TTFT {med['ttft2_ms']:.0f} ms, "
              f"process wall {med['wall_s']:.2f} s")
    same = all(a["tokens"] == b["tokens"] for a, b in zip(rows["module"], rows["step"]))
    print(f"  same greedy tokens in both modes: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
