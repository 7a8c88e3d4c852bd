"""GPU benchmark: dense fully on the tier, layer offload and plans at 10/25/50/100% of the model's bytes.

Measured decode tok/s (median of rounds), the cost model's tok/s for the same placement, the budget
and the bytes over the host<->tier link per token, written to bench/gpu.md. On a machine with CUDA
the tier is the GPU; without one (or with ``--gpu-device cpu``) every row runs the same code on the
CPU tier and is labelled "CPU tier": those rows test the script and the placements, they are not GPU
numbers. ``bash bench/gpu.sh`` / ``make bench-gpu``; ``python -m bench.gpu_bench --help``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
FRACTIONS = (0.10, 0.25, 0.50, 1.00)
CONTEXT_TOKENS = 2048  # the KV cache both the plans and layer offload size


def context_tokens(model: str) -> int:
    """CONTEXT_TOKENS, or the model's own context where shorter (an engine refuses one longer than the model's)."""
    from tandem.core.loading import load_checkpoint
    return min(CONTEXT_TOKENS, load_checkpoint(model, deferred=True).config.max_context)
PROMPT = "Write a short story about a robot who learns to paint. Once upon a time"


def model_bytes(model: str, profile_dir: Path, hardware: str, weight_format: str) -> tuple[int, int]:
    """(bytes of every placeable unit as the planner counts them, the GPU buffers it reserves)."""
    from offline.profile_artifact import load_profile
    from tandem.core.loading import load_checkpoint
    from placement.settings import checkpoint_bytes_per_weight, checkpoint_tensor_formats
    from placement.hardware import load_hardware
    from placement.predictor_info import no_predictors
    from placement.problem import build_problem
    from placement.settings import ActivationStats, PlanSettings, resolve_bytes_per_weight
    ckpt = load_checkpoint(model)
    cfg = ckpt.config
    bpw = checkpoint_bytes_per_weight(ckpt) if weight_format == "auto" else resolve_bytes_per_weight(weight_format)
    formats = checkpoint_tensor_formats(ckpt) if weight_format == "auto" else {}  # as `tandem plan` sets them
    settings = PlanSettings(bytes_per_weight=bpw, context_tokens=min(cfg.max_context, CONTEXT_TOKENS),
                            tensor_formats=formats)
    problem = build_problem(cfg, ActivationStats.from_profile(load_profile(profile_dir), cfg), no_predictors(cfg.num_layers),
                            load_hardware(hardware), 1 << 50, settings)
    total = problem.output_head.gpu_bytes + (problem.embeddings.gpu_bytes if problem.embeddings else 0)
    for layer in problem.layers:  # an FFN as hot chunks costs its neuron indices too: 100% must hold all of them
        ffn = (max(layer.dense_ffn.gpu_bytes, int(sum(layer.chunk_gpu_bytes))) if not layer.is_moe else
               max(o.gpu_bytes for o in layer.expert_options))
        total += layer.attention.gpu_bytes + ffn
    return total, problem.buffer_bytes


def decode_tok_s(engine, tokens: int, rounds: int) -> tuple[float, dict]:
    rates, stats = [], {}
    for _ in range(rounds):
        out = engine.generate(PROMPT, max_new_tokens=tokens, ignore_eos=True)
        rates.append(out.stats["decode_tokens_per_s"])
        stats = out.stats
    return statistics.median(rates), stats


def plan_budget(fraction: float, total: int, reserve: int) -> int:
    """The GPU budget for ``fraction`` of the model's ``total`` planned bytes: + the planner's buffer ``reserve``,
    the ILP's 1 ppm margin and 1 KiB (so 100% holds every unit); fraction 0 is no GPU at all."""
    from placement.ilp import CAPACITY_MARGIN_REL
    if fraction == 0:
        return 0
    budget = reserve + int(fraction * total)
    return budget + math.ceil(budget * CAPACITY_MARGIN_REL) + 1024


def probed_hardware(work: Path) -> str:
    """This machine's `tandem probe` profile (the GPU step's kernel latency included), made once in ``work``."""
    path = work / "hardware-probed.json"
    if not path.exists():
        work.mkdir(parents=True, exist_ok=True)
        from tandem import pipeline
        pipeline.probe(path)
    return str(path)


def make_plan_dir(model: str, profile: Path, hardware: str, budget: int, out: Path, reuse: bool = False,
                  predictors: str | None = None) -> Path:
    if reuse and (out / "plan.json").exists():
        return out
    cmd = [sys.executable, "-m", "tandem.cli", "plan", "--model", model, "--profile", str(profile), "--hardware", hardware,
           "--gpu-budget", str(budget), "--out", str(out), "--replan", "--no-quality", "--time-limit", "20"]
    cmd += ["--predictors", predictors] if predictors else []
    # no prepared CPU step cache: the bench loads each plan once (GiBs at real sizes for a plan at 0 bytes)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "TANDEM_STEP_CACHE": "0"})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--profile", default="profiles/SmolLM2-135M-Instruct.Q4_1/profile")
    p.add_argument("--predictors", default=None, help="train-predictors output: plans gate their cold rows with it")
    p.add_argument("--hardware", default="auto",
                   help="preset or `tandem probe` JSON the plans are made for; auto: this machine probed (once, "
                        "kept in --work) when the tier is CUDA, else rtx4090")
    p.add_argument("--gpu-device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    p.add_argument("--out", default=str(BENCH_DIR / "gpu.md"))
    p.add_argument("--work", default="/tmp/tandem-bench-gpu", help="where the plans are written")
    p.add_argument("--reuse-plans", action="store_true", help="use the plans already in --work (made elsewhere)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--skip-dense", action="store_true")
    args = p.parse_args(argv)
    import torch
    from online import Engine
    from placement.budget import format_bytes
    from tandem.core.artifacts import atomic_write_bytes
    from placement.plan import read_plan
    device = args.gpu_device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.hardware == "auto":
        args.hardware = probed_hardware(Path(args.work)) if device == "cuda" else "rtx4090"
    tier_label = "GPU" if device == "cuda" else "CPU tier (no GPU: not GPU numbers)"
    total, reserve = model_bytes(args.model, Path(args.profile), args.hardware, "auto")
    rows = []

    def row(name: str, budget: int, load, modeled):
        try:
            engine = load()
            tok_s, stats = decode_tok_s(engine, args.tokens, args.rounds)
        except Exception as exc:  # noqa: BLE001 - one failing row is reported, the others still run
            rows.append((name, format_bytes(budget), f"failed: {str(exc).splitlines()[0][:120]}", "-", "-", "-", "-", "-"))
            print(" | ".join(rows[-1]), flush=True)
            return
        step = engine.compiled_decode
        launches = getattr(step, "launches_per_token", None) or getattr(getattr(step, "gpu_layers", None),
                                                                       "launches_per_token", "-")
        rows.append((name, format_bytes(budget), f"{tok_s:.2f}", "-" if modeled is None else f"{modeled:.1f}",
                     str(stats.get("link_bytes_per_token", 0)), str(stats.get("tier_syncs_per_token", 0)),
                     f"{launches} / {stats.get('graph_replays_per_token', 0)}",
                     stats.get("decode_path", "?")))
        print(" | ".join(rows[-1]), flush=True)

    threads = {"threads": args.threads} if args.threads else {}
    context = context_tokens(args.model)
    row("CPU only (fused C step, layer offload at 0 bytes)", 0,
        lambda: Engine.load(args.model, layer_offload=True, gpu_budget_bytes=0, gpu_device=device,
                            context_length=context, **threads), None)
    if not args.skip_dense:
        row("dense, all layers + output layer on the GPU (layer offload, 100%)", reserve + 2 * total,
            lambda: Engine.load(args.model, layer_offload=True, gpu_budget_bytes=reserve + 2 * total, gpu_device=device,
                                context_length=context, **threads), None)
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget = plan_budget(fraction, total, reserve)
        plan_dir = make_plan_dir(args.model, Path(args.profile), args.hardware, budget,
                                 Path(args.work) / f"plan-{fraction:g}", args.reuse_plans, args.predictors)
        plan = read_plan(plan_dir)
        row(f"layer offload at {fraction:.0%}", budget,
            lambda: Engine.load(args.model, layer_offload=True, gpu_budget_bytes=budget, gpu_device=device,
                                context_length=context, **threads),
            plan.modeled.get("layer_offload_tokens_per_s"))
        row(f"plan at {fraction:.0%}", budget,
            lambda: Engine.load(args.model, plan=plan_dir, gpu_device=device, profile=args.profile,
                                predictors=args.predictors, **threads),
            plan.modeled.get("tokens_per_s"))
    head = ["| run | budget | measured tok/s | modeled tok/s | link bytes/token | tier syncs/token "
            "| launches / graph replays per token | decode path |", "|---|---|---|---|---|---|---|---|"]
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        "# GPU benchmark (bench/gpu.sh)", "",
        f"Tier: **{tier_label}**. Machine: {platform.node()} ({platform.machine()}), {torch.get_num_threads()} torch threads, "
        f"{when}. Model {args.model}; model bytes as planned {format_bytes(total)} (budgets add the planner's {format_bytes(reserve)} buffer reserve); plans for `{args.hardware}`; "
        f"{args.tokens} decoded tokens, median of {args.rounds} rounds. Modeled = the plan's cost model (not measured).",
        f"Command: `python -m bench.gpu_bench {' '.join(argv if argv is not None else sys.argv[1:])}`", ""] + head
        + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
    out = Path(args.out)
    atomic_write_bytes(out, text.encode())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
