"""The cost model against the GPU table: each measured row's placement (the plans' own, layer offload's
-ngl, all on the GPU, all on the CPU) evaluated for a hardware profile, beside bench/gpu.md's measured
tok/s. ``python -m bench.gpu_model_check --hardware h100 --plans .dev/plans``.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent


def measured_rows(table: Path) -> dict[str, float]:
    rows = {}
    for line in table.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"[0-9.]+", cells[2] or "x"):
            rows[cells[0]] = float(cells[2])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--profile", default="profiles/SmolLM2-135M-Instruct.Q4_1/profile")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--plans", default=".dev/plans", help="the plans the table measured (plan-<fraction>)")
    p.add_argument("--table", default=str(BENCH_DIR / "gpu.md"))
    args = p.parse_args(argv)
    from offline.profile_artifact import load_profile
    from placement.cost_model import Placement, all_cpu_placement, evaluate_placement, layer_offload_estimate
    from placement.hardware import load_hardware
    from placement.plan import read_plan
    from placement.predictor_info import no_predictors
    from placement.problem import build_problem
    from placement.settings import ActivationStats, PlanSettings, checkpoint_bytes_per_weight, checkpoint_tensor_formats
    from tandem.core.loading import load_checkpoint
    from bench.gpu_bench import CONTEXT_TOKENS
    ckpt = load_checkpoint(args.model)
    cfg, hw = ckpt.config, load_hardware(args.hardware)
    settings = PlanSettings(bytes_per_weight=checkpoint_bytes_per_weight(ckpt), context_tokens=CONTEXT_TOKENS,
                            tensor_formats=checkpoint_tensor_formats(ckpt))
    stats = ActivationStats.from_profile(load_profile(args.profile), cfg)

    def problem(budget: int):
        return build_problem(cfg, stats, no_predictors(cfg.num_layers), hw, budget, settings)
    measured = measured_rows(Path(args.table))
    out = [("CPU only (fused C step, layer offload at 0 bytes)", evaluate_placement(problem(0), all_cpu_placement(problem(0))).tokens_per_s)]
    full = problem(1 << 40)
    everything = Placement(attention_on_gpu=[True] * cfg.num_layers, predictor_on_gpu=[False] * cfg.num_layers,
                           gpu_chunks=[np.ones(layer.num_chunks, dtype=bool) for layer in full.layers],
                           expert_option=[0] * cfg.num_layers, shared_expert_on_gpu=[False] * cfg.num_layers,
                           output_head_on_gpu=True, embeddings_on_gpu=True)
    out.append(("dense, all layers + output layer on the GPU (layer offload, 100%)", evaluate_placement(full, everything).tokens_per_s))
    for plan_dir in sorted(Path(args.plans).glob("plan-*"), key=lambda d: float(d.name[5:])):
        fraction = float(plan_dir.name[5:])
        plan = read_plan(plan_dir)
        prob = problem(plan.gpu_budget_bytes)
        out.append((f"layer offload at {fraction:.0%}", layer_offload_estimate(prob).tokens_per_s))
        chunks = []
        for i, layer in enumerate(prob.layers):
            on_gpu = set(plan.gpu_neurons(i).tolist())
            chunks.append(np.array([set(c.tolist()) <= on_gpu for c in layer.chunk_neurons], dtype=bool))
        placement = Placement(attention_on_gpu=plan.attention_on_gpu, predictor_on_gpu=[False] * cfg.num_layers,
                              gpu_chunks=chunks, expert_option=[0] * cfg.num_layers,
                              shared_expert_on_gpu=[False] * cfg.num_layers, output_head_on_gpu=plan.output_head_on_gpu,
                              embeddings_on_gpu=plan.embeddings_on_gpu)
        out.append((f"plan at {fraction:.0%}", evaluate_placement(prob, placement).tokens_per_s))
    print(f"| row | measured tok/s ({args.table}) | modeled tok/s ({args.hardware}) | modeled / measured |")
    print("|---|---|---|---|")
    for name, modeled in out:
        got = measured.get(name)
        ratio = f"{modeled / got:.2f}" if got else "-"
        print(f"| {name} | {got if got else '-'} | {modeled:.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
