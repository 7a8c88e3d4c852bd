"""Where a GPU-step token goes: the step's launches, graph replays and host actions, timed alone.

``python -m bench.gpu_profile --plan DIR [--tokens 64]``: decode tok/s through ``generate``, then per token
the step call, the replays alone (each followed by a sync) and the rest (host actions, copies, waits).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--plan", required=True)
    p.add_argument("--profile", default="profiles/SmolLM2-135M-Instruct.Q4_1/profile")
    p.add_argument("--predictors", default=None, help="the plan's predictors (when not beside it)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    import torch
    from online import Engine
    engine = Engine.load(args.model, plan=args.plan, profile=args.profile, predictors=args.predictors,
                         **({"threads": args.threads} if args.threads else {}))
    prompt = "Write a short story about a robot. Once upon a time"
    engine.generate(prompt, max_new_tokens=8, ignore_eos=True)  # the first tokens compile and capture
    out = engine.generate(prompt, max_new_tokens=args.tokens, ignore_eos=True)
    print(f"decode_path {engine.decode_path} ({engine.decode_path_reason}); decode tok/s "
          f"{out.stats['decode_tokens_per_s']}; " + ", ".join(f"{k} {out.stats.get(k)}" for k in (
              "tier_syncs_per_token", "link_bytes_per_token", "gpu_launches_per_token", "graph_replays_per_token")))
    step = engine.compiled_decode
    runner = getattr(getattr(step, "layers", None), "runner", None)
    if runner is None or not runner.graphs:
        print("no captured graphs to profile")
        return 0
    cache = engine._kv_cache(256)
    pos = len(out.token_ids)
    calls = []
    for i in range(50):
        t = time.perf_counter()
        step(1, pos, cache)
        calls.append(time.perf_counter() - t)
    replays = []
    for i in range(50):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for g in runner.graphs:
            if g is not None:
                g.replay()
        torch.cuda.synchronize()
        replays.append(time.perf_counter() - t)
    call_us, replay_us = statistics.median(calls) * 1e6, statistics.median(replays) * 1e6
    print(f"per token: step call {call_us:.0f} us, graph replays alone {replay_us:.0f} us "
          f"({runner.groups_per_token} graphs, {runner.launches_per_token} launches), "
          f"host actions + copies + waits {call_us - replay_us:.0f} us")
    host_action_times(step, runner, pos, cache)
    return 0


def host_action_times(step, runner, pos: int, cache, tokens: int = 30) -> None:
    """Each host action's median wall time per token (its waits included: a fetch waits for the launches
    before it), printed as one line."""
    from online.gpu.stack import Host
    host_names = iter([a.name for a in step.layers.runner_actions if isinstance(a, Host) and a.barrier])
    times: dict = {}
    items = []
    for kind, item in runner.items:
        if kind == "host":
            name = next(host_names, "host")

            def timed(fn=item, name=name):
                t = time.perf_counter()
                fn()
                times.setdefault(name, []).append(time.perf_counter() - t)
            items.append((kind, timed))
        else:
            items.append((kind, item))
    saved, runner.items = runner.items, items
    try:
        for i in range(tokens):
            step(1, pos + i, cache)
    finally:
        runner.items = saved
    print("host actions (median us/token): " + ", ".join(
        f"{n} {statistics.median(v) * 1e6:.0f}" for n, v in times.items()))


if __name__ == "__main__":
    sys.exit(main())
