"""Profiles and plans for the tiny test models, made through the same code `tandem prepare` runs.

Example::

    profile_dir = tiny_profile(folder, tmp_path)                       # tmp_path/profile
    plan_dir = tiny_plan(folder, tmp_path, "rtx4090", fraction=0.5)    # tmp_path/plan-rtx4090-0.5
"""
from __future__ import annotations

from pathlib import Path

import torch

RESERVE_BYTES = 64 * 1024  # tiny models: a small fixed reserve instead of the 8 MiB workspace estimate
CONTEXT_TOKENS = 64


def tiny_profile(folder: Path, out: Path) -> Path:
    from offline.profile_artifact import save_profile
    from offline.profiler import profile_model
    from online import Engine
    target = out / "profile"
    if not target.exists():
        engine = Engine.load(str(folder))
        g = torch.Generator().manual_seed(0)
        docs = [torch.randint(0, engine.config.vocab_size, (30,), generator=g).tolist() for _ in range(10)]
        save_profile(profile_model(engine, docs, window_tokens=32, search_steps=2, progress=False), target)
    return target


def plan_settings(weight_format: str = "int4", tensor_formats: dict | None = None):
    from placement.settings import PlanSettings
    return PlanSettings(bytes_per_weight=weight_format, context_tokens=CONTEXT_TOKENS, neurons_per_chunk=16,
                        gpu_reserve_bytes=RESERVE_BYTES, tensor_formats=tensor_formats or {})


def full_model_bytes(folder: Path, profile_dir: Path, hardware: str = "rtx4090", weight_format: str = "int4",
                     tensor_formats: dict | None = None) -> int:
    """Bytes of every placeable unit (what a plan with room for everything puts on the GPU)."""
    from offline.profile_artifact import load_profile
    from tandem.core.loading import load_checkpoint
    from placement.hardware import load_hardware
    from placement.predictor_info import no_predictors
    from placement.problem import build_problem
    from placement.settings import ActivationStats
    ckpt = load_checkpoint(str(folder))
    cfg = ckpt.config
    profile = load_profile(profile_dir)
    problem = build_problem(cfg, ActivationStats.from_profile(profile, cfg), no_predictors(cfg.num_layers),
                            load_hardware(hardware), 1 << 40, plan_settings(weight_format, tensor_formats))
    total = problem.output_head.gpu_bytes + (problem.embeddings.gpu_bytes if problem.embeddings else 0)
    for layer in problem.layers:
        total += layer.attention.gpu_bytes + int(layer.chunk_gpu_bytes.sum())
        if layer.is_moe:
            total += max(o.gpu_bytes for o in layer.expert_options)
            total += layer.shared_expert.gpu_bytes if layer.shared_expert is not None else 0
    return total


def tiny_plan(folder: Path, out: Path, hardware: str, fraction: float, weight_format: str = "int4",
              tensor_formats: dict | None = None) -> Path:
    """A plan with budget = reserve + ``fraction`` of the model's bytes (0: an all-CPU plan)."""
    from offline.profile_artifact import load_profile
    from tandem.core.loading import load_checkpoint
    from placement.hardware import load_hardware
    from placement.plan import save_plan
    from placement.planner import make_plan
    profile_dir = tiny_profile(folder, out)
    ckpt = load_checkpoint(str(folder))
    full = full_model_bytes(folder, profile_dir, hardware, weight_format, tensor_formats)
    budget = 0 if fraction == 0 else RESERVE_BYTES + int(fraction * full)
    plan = make_plan(ckpt.config, model_fingerprint=ckpt.fingerprint, model_id=ckpt.model_id,
                     profile=load_profile(profile_dir), hardware=load_hardware(hardware), gpu_budget_bytes=budget,
                     settings=plan_settings(weight_format, tensor_formats))
    return save_plan(plan, out / f"plan-{hardware}-{weight_format}-{fraction}")


def tier_units_model(folder: Path, attention, head: bool, embeddings: bool, weight_format: str = "fp32",
                     tier_format: str = "fp32", kv_dtype=torch.float32, seed: int = 3, hot_neurons: int = 40,
                     hot_format: str = "fp32"):
    """A tiny model split by hand (no plan): ``hot_neurons`` random neurons per layer on a CPU tier (stored in
    ``hot_format``), attention per layer where ``attention`` says, the output layer / embeddings there when asked
    (in ``tier_format``). Returns (model, executor, tier).

    Example::

        model, executor, tier = tier_units_model(folder, (True, False), head=True, embeddings=False)
    """
    from online.execution.gpu_tier import GpuTier
    from online.execution.hybrid import ExecutionSettings, HybridExecutor
    from online.execution.tier_units import place_plan_units
    from tandem.core.loading.hf_loader import load_hf_folder
    from tandem.core.model.build import build_model
    model, ffn = build_model(load_hf_folder(folder))
    tier = GpuTier.create(1 << 24, "cpu")
    gen = torch.Generator().manual_seed(seed)
    hot = [torch.randperm(model.cfg.intermediate_size, generator=gen)[:hot_neurons] for _ in range(model.cfg.num_layers)]
    settings = ExecutionSettings(weight_format=weight_format, sparse=False, threads=1, tier_format=hot_format)
    executor = HybridExecutor.build(model.cfg, ffn, tier, settings, gpu_neurons=hot, head_weight=model.lm_head.weight)
    place_plan_units(model, executor, tier, attention_on_gpu=list(attention), output_head_on_gpu=head,
                     embeddings_on_gpu=embeddings, tier_format=tier_format, kv_dtype=kv_dtype, kv_capacity_tokens=16)
    return model, executor, tier
