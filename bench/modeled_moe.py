"""Modeled decode speed of Mixtral-8x7B-shaped expert offloading on the `t4` and `rtx4090` presets.

Everything here is MODELED with placement's cost model (nothing runs a Mixtral): per-unit times
are ``placement.cost_model`` primitives (bytes / bandwidth, flops / rate), LRU hit rates come
from ``placement.expert_cache_model`` (Che's approximation), and Tandem's own plan is
``placement.planner.make_plan`` (ILP over pinned experts x LRU slots, copy-or-CPU per miss,
attention / head placement) with a synthetic profile.

Assumptions (stated in the report too):
- Mixtral-8x7B shapes (32 layers, d 4096, 8 experts of 14336, top-2, 32k vocab, GQA 32/8);
- weights at 0.375 bytes per weight: mixtral-offloading quantized experts to 2-3 bits and attention
  to 4 bits with HQQ; ~3 bits per weight with group scales is our single-number summary;
- expert load uniform (1/4 of tokens per expert) and 20% of tokens repeating the previous token's
  expert pair; context 1024 tokens;
- mixtral-offloading-like baselines keep attention on the GPU plus 4 LRU slots per layer
  (its demo's ``offload_per_layer = 4``) and copy every miss; prefetch is modeled with what it did
  on our MoEfied-SmolLM2 trace at 4 slots: it turns a share of the LRU's demand copies into
  prefetch copies (and adds wasted ones); prefetch copies share the PCIe link but overlap the
  layer's GPU compute, demand copies block.

Example::

    rows = modeled_rows(demand_ratio=0.62, prefetch_ratio=0.95)
"""
from __future__ import annotations

import numpy as np
import torch

from offline.profile_artifact import Profile
from tandem.core.config import ModelConfig
from placement import cost_model
from placement.expert_cache_model import lru_hit_rate
from placement.hardware import load_hardware
from placement.ilp import SolverSettings
from placement.planner import default_gpu_budget, make_plan
from placement.predictor_info import no_predictors
from placement.problem import build_problem, estimate_buffer_bytes
from placement.settings import ActivationStats, PlanSettings

BYTES_PER_WEIGHT = 0.375
SLOTS = 4
REPEAT_RATE = 0.2
CONTEXT_TOKENS = 1024
PUBLISHED = {  # mixtral-offloading (arXiv 2312.17238), Mixtral-8x7B tok/s, measured by its authors
    "t4": {"full": 2.09, "no_prefetch": 1.57, "no_cache": 1.17, "naive": 0.66},
    "a100": {"full": 3.06, "no_prefetch": 2.92, "no_cache": 2.27, "naive": 1.39},
}


def mixtral_8x7b_config() -> ModelConfig:
    return ModelConfig(arch="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
                       max_context=32768, rope_theta=1e6)


def synthetic_profile(config: ModelConfig) -> Profile:
    n_layers, n_experts = config.num_layers, config.num_experts
    freq = config.num_experts_per_tok / n_experts
    tensors = {"neuron_freq": torch.zeros(n_layers, 1), "hot_order": torch.zeros(n_layers, 1, dtype=torch.long),
               "neuron_mean_abs": torch.zeros(n_layers, 1), "thresholds": torch.zeros(n_layers),
               "layer_sparsity": torch.zeros(n_layers), "expert_freq": torch.full((n_layers, n_experts), freq),
               "expert_repeat": torch.full((n_layers,), REPEAT_RATE)}
    return Profile(model_fingerprint="modeled-mixtral-8x7b", model_id="Mixtral-8x7B (shape)", activity="threshold",
                   tensors=tensors, calibration={"source": "synthetic: uniform expert load", "repeat_rate": REPEAT_RATE})


def offloading_budget(config: ModelConfig, settings: PlanSettings) -> int:
    """GPU bytes of mixtral-offloading's holding: attention + KV, router, head, embeddings, buffers
    and SLOTS experts per layer."""
    bpw, d = settings.bytes_per_weight, config.hidden_size
    kv_dim = config.num_kv_heads * config.head_dim
    attention = (2 * d * config.num_heads * config.head_dim + 2 * d * kv_dim + config.num_experts * d) * bpw
    kv = 2 * kv_dim * settings.context_tokens * settings.kv_bytes_per_element
    expert = 3 * d * config.moe_intermediate_size * bpw
    head = 2 * config.vocab_size * d * bpw
    total = config.num_layers * (attention + kv + SLOTS * expert) + head + estimate_buffer_bytes(config, settings)
    return int(np.ceil(total / 2**20)) * 2**20


def _baselines(config: ModelConfig, hw, settings: PlanSettings, budget: int, demand_ratio: float,
               prefetch_ratio: float) -> dict:
    """Per-token seconds of mixtral-offloading-like policies and of all-experts-on-CPU (Fiddler-like).

    ``demand_ratio`` / ``prefetch_ratio``: demand copies and prefetch copies with prefetch on, per
    copy of LRU alone (measured on a trace)."""
    stats = ActivationStats.from_profile(synthetic_profile(config), config)
    problem = build_problem(config, stats, no_predictors(config.num_layers), hw, budget, settings)
    bpw, k = settings.bytes_per_weight, config.num_experts_per_tok
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * bpw
    gpu_s = float(cost_model.gpu_weight_seconds(expert_bytes, bpw, hw))
    cpu_s = float(cost_model.cpu_weight_seconds(expert_bytes, bpw, hw))
    copy_s = expert_bytes / hw.h2d_bandwidth_bytes_per_s
    hit = lru_hit_rate(stats.expert_freq[0], SLOTS, REPEAT_RATE)
    misses = k * (1.0 - hit)  # LRU demand copies per layer and token
    fixed = problem.output_head.gpu_s + (problem.embeddings.gpu_s if problem.embeddings else 0.0)
    out = {"naive": fixed, "no_prefetch": fixed, "full": fixed, "fiddler": fixed, "lru_hit_rate": hit}
    for layer in problem.layers:
        compute = layer.attention.gpu_s + k * gpu_s
        out["naive"] += layer.attention.gpu_s + k * (copy_s + gpu_s)
        out["no_prefetch"] += compute + misses * copy_s
        demand, prefetched = demand_ratio * misses * copy_s, prefetch_ratio * misses * copy_s
        out["full"] += compute + demand + max(0.0, prefetched - compute)
        out["fiddler"] += layer.attention.gpu_s + k * cpu_s + hw.layer_sync_latency_s
    return out


def modeled_rows(demand_ratio: float, prefetch_ratio: float, time_limit_s: float = 10.0) -> list[dict]:
    config = mixtral_8x7b_config()
    settings = PlanSettings(bytes_per_weight=BYTES_PER_WEIGHT, context_tokens=CONTEXT_TOKENS)
    rows = []
    for name in ("t4", "rtx4090"):
        hw = load_hardware(name)
        holding = offloading_budget(config, settings)
        for label, budget in (("mixtral-offloading's holding", holding), ("90% of the GPU", default_gpu_budget(hw))):
            plan = make_plan(config, model_fingerprint="modeled-mixtral-8x7b", model_id="Mixtral-8x7B (shape)",
                             profile=synthetic_profile(config), hardware=hw, gpu_budget_bytes=budget, settings=settings,
                             solver=SolverSettings(time_limit_s=time_limit_s))
            base = _baselines(config, hw, settings, budget, demand_ratio, prefetch_ratio)
            slots = plan.expert_cache_slots.double().mean().item()
            pinned = plan.expert_pinned.double().sum(1).mean().item()
            rows.append({"hardware": name, "budget_label": label, "budget_gib": budget / 2**30,
                         "plan_tok_s": float(plan.modeled["tokens_per_s"]), "plan_slots": slots, "plan_pinned": pinned,
                         "layer_offload_tok_s": float(plan.modeled["layer_offload_tokens_per_s"]),
                         "naive_tok_s": 1.0 / base["naive"], "no_prefetch_tok_s": 1.0 / base["no_prefetch"],
                         "full_tok_s": 1.0 / base["full"], "fiddler_tok_s": 1.0 / base["fiddler"],
                         "lru_hit_rate": base["lru_hit_rate"], "solver": plan.solver["status"]})
    return rows
