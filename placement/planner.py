"""Make a plan: budget checks, greedy baseline, ILP, modeled comparisons, the Plan artifact.

Needs only a ModelConfig (no weights), so a 70B-shaped model can be planned from its config.

Example::

    plan = make_plan(cfg, model_fingerprint=ckpt.fingerprint, model_id=ckpt.model_id, profile=profile,
                     hardware=load_hardware("rtx4090"), gpu_budget_bytes=parse_bytes("2GiB"),
                     settings=PlanSettings(bytes_per_weight=0.5625))
    save_plan(plan, "profiles/m/plan-rtx4090-2GiB")
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from tandem.core.config import ModelConfig
from tandem.core.errors import TandemError

from .budget import format_bytes
from .cost_model import (Evaluation, Placement, all_cpu_dense_seconds, all_cpu_sparse_seconds,
                         evaluate_placement, layer_offload_estimate)
from .greedy import greedy_placement
from .hardware import MiB, HardwareProfile
from .ilp import SolverSettings, SolveResult, solve_placement
from .plan import Plan
from .predictor_info import PredictorInfo, no_predictors
from .problem import PlacementProblem, build_problem, estimate_buffer_bytes
from .settings import ActivationStats, PlanSettings

DEFAULT_GPU_MEMORY_SHARE = 0.9  # default budget: 90% of the GPU's memory (CUDA context, fragmentation)
MAX_TOTAL_CHUNKS = 40_000  # above this many FFN chunks, chunks get coarser (reported in the plan)


def default_gpu_budget(hardware: HardwareProfile) -> int:
    """90% of the GPU's memory in whole MiB; 0 without a GPU."""
    return int(hardware.gpu_memory_bytes * DEFAULT_GPU_MEMORY_SHARE) // MiB * MiB


def check_budget(config: ModelConfig, hardware: HardwareProfile, gpu_budget_bytes: int, settings: PlanSettings) -> None:
    """Refuse budgets the hardware cannot give or too small for the GPU tier's buffers."""
    if gpu_budget_bytes < 0:
        raise TandemError(f"GPU budget cannot be negative ({gpu_budget_bytes})")
    if not hardware.has_gpu:
        if gpu_budget_bytes:
            raise TandemError(f"hardware {hardware.name!r} has no GPU: the plan is all-CPU, use --gpu-budget 0 or leave it out")
        return
    if gpu_budget_bytes > hardware.gpu_memory_bytes:
        raise TandemError(f"GPU budget {format_bytes(gpu_budget_bytes)} exceeds {hardware.name}'s GPU memory "
                          f"({format_bytes(hardware.gpu_memory_bytes)})")
    essential = estimate_buffer_bytes(config, settings)
    if 0 < gpu_budget_bytes < essential:
        raise TandemError(f"GPU budget {format_bytes(gpu_budget_bytes)} ({gpu_budget_bytes} bytes) is too small for the "
                          f"GPU tier's buffers (activations, logits, workspace); the smallest budget that works is "
                          f"{format_bytes(essential)} ({essential} bytes), or 0 for an all-CPU plan")


def _layer_summaries(problem: PlacementProblem, placement: Placement, evaluation: Evaluation) -> list[dict[str, Any]]:
    summaries = []
    for i, (layer, timing) in enumerate(zip(problem.layers, evaluation.layers)):
        option = layer.expert_options[placement.expert_option[i]] if layer.is_moe else None
        summaries.append({
            "index": i, "is_moe": layer.is_moe,
            "attention_on_gpu": bool(placement.attention_on_gpu[i]),
            "predictor_on_gpu": bool(placement.predictor_on_gpu[i]) if layer.predictor is not None else None,
            "gpu_neurons": timing.gpu_neurons, "gpu_activation_share": round(timing.gpu_activation_share, 6),
            "experts_pinned": option.pinned_count if option else 0, "expert_cache_slots": option.cache_slots if option else 0,
            "shared_expert_on_gpu": bool(placement.shared_expert_on_gpu[i]) if layer.shared_expert is not None else None,
            "attention_s": timing.attention_s, "predictor_s": timing.predictor_s, "ffn_gpu_s": timing.ffn_gpu_s,
            "ffn_cpu_s": timing.ffn_cpu_s, "sync_s": timing.sync_s, "total_s": timing.total_s})
    return summaries


def _plan_tensors(config: ModelConfig, problem: PlacementProblem, placement: Placement) -> dict[str, torch.Tensor]:
    num_layers, width, num_experts = config.num_layers, config.intermediate_size, config.num_experts
    mask = torch.zeros(num_layers, width, dtype=torch.bool)  # [L, F]
    pinned = torch.zeros(num_layers, num_experts, dtype=torch.bool)  # [L, E]
    slots = torch.zeros(num_layers, dtype=torch.int64)  # [L]
    for i, layer in enumerate(problem.layers):
        if layer.is_moe:
            option = layer.expert_options[placement.expert_option[i]]
            pinned[i, torch.from_numpy(layer.expert_popularity_order[:option.pinned_count].copy())] = True
            slots[i] = option.cache_slots
        elif layer.num_chunks:
            on_gpu = np.asarray(placement.gpu_chunks[i], dtype=bool)
            neurons = [chunk for chunk, keep in zip(layer.chunk_neurons, on_gpu) if keep]
            if neurons:
                mask[i, torch.from_numpy(np.concatenate(neurons).astype(np.int64))] = True
    tensors = {"gpu_neuron_mask": mask, "expert_pinned": pinned, "expert_cache_slots": slots,
               "attention_on_gpu": torch.tensor([bool(x) for x in placement.attention_on_gpu], dtype=torch.bool)}
    for i in range(num_layers):
        tensors[f"layers.{i}.gpu_neurons"] = mask[i].nonzero().flatten()  # [n_i] int64, ascending
    return tensors


def make_plan(config: ModelConfig, *, model_fingerprint: str, model_id: str, profile: Any, hardware: HardwareProfile,
              gpu_budget_bytes: int | None = None, predictors: PredictorInfo | None = None,
              settings: PlanSettings = PlanSettings(), solver: SolverSettings = SolverSettings()) -> Plan:
    """Plan placement for ``config`` on ``hardware`` within ``gpu_budget_bytes`` (default: 90% of the GPU)."""
    start = time.perf_counter()
    budget = default_gpu_budget(hardware) if gpu_budget_bytes is None else int(gpu_budget_bytes)
    check_budget(config, hardware, budget, settings)
    predictors = predictors or no_predictors(config.num_layers)
    stats = ActivationStats.from_profile(profile, config)
    problem = build_problem(config, stats, predictors, hardware, budget, settings, max_total_chunks=MAX_TOTAL_CHUNKS)
    greedy = greedy_placement(problem)
    result: SolveResult = solve_placement(problem, greedy, solver)
    placement = result.placement
    evaluation = evaluate_placement(problem, placement)
    if evaluation.gpu_bytes > budget or evaluation.min_rule_violations:  # never expected: both solvers check
        raise TandemError("internal error: the plan breaks its budget or the minimum-or-none rule")
    offload = layer_offload_estimate(problem)
    dense_cpu_s, sparse_cpu_s = all_cpu_dense_seconds(problem), all_cpu_sparse_seconds(problem)
    improvement = None
    if result.ilp_objective_s is not None:
        improvement = result.greedy_objective_s / result.objective_s - 1.0
    solver_meta = {
        "status": result.status, "gap_rel": result.gap_rel, "chosen": result.chosen, "note": result.note,
        "ilp_objective_s": result.ilp_objective_s, "greedy_objective_s": result.greedy_objective_s,
        "improvement_over_greedy": improvement, "solve_time_s": round(result.solve_time_s, 3),
        "plan_time_s": round(time.perf_counter() - start, 3), "time_limit_s": solver.time_limit_s,
        "gap_limit_rel": solver.gap_rel, "requested_neurons_per_chunk": settings.neurons_per_chunk,
        "neurons_per_chunk": problem.neurons_per_chunk,
        "chunks_coarsened": problem.neurons_per_chunk != settings.neurons_per_chunk,
        "buffer_bytes": problem.buffer_bytes}
    modeled = {
        "label": "modeled (cost model, not measured)",
        "time_per_token_s": evaluation.time_per_token_s, "tokens_per_s": evaluation.tokens_per_s,
        "output_head_s": evaluation.output_head_s, "embeddings_s": evaluation.embeddings_s,
        "layer_offload_tokens_per_s": offload.tokens_per_s, "layer_offload_gpu_layers": offload.gpu_layers,
        "layer_offload_output_head_on_gpu": offload.output_head_on_gpu, "layer_offload_gpu_bytes": offload.gpu_bytes,
        "all_cpu_dense_tokens_per_s": 1.0 / dense_cpu_s, "all_cpu_sparse_tokens_per_s": 1.0 / sparse_cpu_s,
        "speedup_vs_layer_offload": offload.time_per_token_s / evaluation.time_per_token_s}
    return Plan(model_fingerprint=model_fingerprint, model_id=model_id,
                profile_fingerprint=profile.fingerprint, predictors_fingerprint=predictors.fingerprint,
                hardware=hardware, gpu_budget_bytes=budget, settings=settings, model_config=config.to_dict(),
                solver=solver_meta, modeled=modeled, gpu_bytes_by_kind={k: int(v) for k, v in evaluation.gpu_bytes_by_kind.items()},
                layers=_layer_summaries(problem, placement, evaluation),
                output_head_on_gpu=bool(placement.output_head_on_gpu), embeddings_on_gpu=bool(placement.embeddings_on_gpu),
                tensors=_plan_tensors(config, problem, placement))
