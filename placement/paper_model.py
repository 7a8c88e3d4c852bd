"""Modeled replay of PowerInfer's evaluation setting with Tandem's cost model and planner.

PowerInfer (arXiv 2312.12456) ran ReLU models (OPT-30B, Falcon(ReLU)-40B, ...) on an RTX 4090 +
i9-13900K and compared with llama.cpp's layer offload. We cannot run those models here, so we
plan OPT-30B- and Falcon-40B-shaped configs with synthetic power-law activation statistics of the
kind the paper reports, and compare the modeled decode time with llama.cpp-style layer offload on
the same budget. Every number produced here is modeled, not measured.

Assumptions (stated in the bench output too):
- skew: 26% of a layer's neurons carry 80% of its activations (the paper's OPT-30B figure), the
  same for Falcon-40B; frequencies follow ``min(1, c * rank^-alpha)`` fitted to that skew;
- sparsity: 10% of FFN neurons active per token on average (swept 5-20%);
- predictors in every layer: 7% of the model's parameters for OPT-30B, 8.68% for Falcon-40B (the
  paper's sizes for OPT and Falcon-40B), recall 0.95, marking 1.25x the truly active neurons;
- budget: 22 GiB of the RTX 4090's 24 GiB for both systems; context 256 tokens.

Example::

    rows = modeled_rows(time_limit_s=20)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from offline.profile_artifact import Profile
from tandem.core.config import ModelConfig

from .hardware import GiB, HardwareProfile, load_hardware
from .ilp import SolverSettings
from .planner import make_plan
from .predictor_info import LayerPredictorInfo, PredictorInfo
from .settings import PlanSettings, resolve_bytes_per_weight

PAPER_MEASURED = {  # PowerInfer paper, RTX 4090 (PC-High), speedup over llama.cpp
    "fp16_average": 7.23, "fp16_max_falcon40b": 11.69, "int4_average": 2.89, "int4_max": 4.28}


def opt_30b_config() -> ModelConfig:
    """OPT-30B's shapes (facebook/opt-30b config.json): ReLU, ungated FFN, LayerNorm."""
    return ModelConfig(arch="opt", vocab_size=50272, hidden_size=7168, intermediate_size=28672, num_layers=48,
                       num_heads=56, num_kv_heads=56, norm="layer", position="learned", mlp_gated=False,
                       mlp_bias=True, hidden_act="relu", max_context=2048, position_offset=2)


def falcon_40b_config() -> ModelConfig:
    """Falcon-40B's shapes (tiiuae/falcon-40b: 60 layers, d 8192, 128 heads, 8 KV groups, FFN 4d),
    with ReLU in place of GELU as in the ReLU-fied checkpoint PowerInfer used."""
    return ModelConfig(arch="llama", vocab_size=65024, hidden_size=8192, intermediate_size=32768, num_layers=60,
                       num_heads=128, num_kv_heads=8, norm="layer", mlp_gated=False, hidden_act="relu", max_context=2048)


@dataclass(frozen=True)
class PaperSetting:
    name: str
    config: ModelConfig
    predictor_share_of_model: float
    active_fraction: float = 0.10
    hot_neuron_share: float = 0.26
    hot_mass_share: float = 0.80
    predictor_recall: float = 0.95
    overprediction: float = 1.25


def power_law_frequencies(num_neurons: int, active_fraction: float, hot_neuron_share: float,
                          hot_mass_share: float) -> np.ndarray:
    """Descending activation frequencies ``min(1, c * rank^-alpha)`` with the given mean and skew."""
    ranks = np.arange(1, num_neurons + 1, dtype=np.float64)
    hot_count = max(1, int(round(hot_neuron_share * num_neurons)))

    def with_mean(alpha: float) -> np.ndarray:
        shape = ranks ** -alpha
        low, high = 0.0, active_fraction / shape.mean() * 4 + 1.0
        while np.minimum(1.0, high * shape).mean() < active_fraction:
            high *= 2
        for _ in range(80):
            mid = 0.5 * (low + high)
            low, high = (mid, high) if np.minimum(1.0, mid * shape).mean() < active_fraction else (low, mid)
        return np.minimum(1.0, 0.5 * (low + high) * shape)

    low, high = 0.0, 4.0
    for _ in range(60):
        mid = 0.5 * (low + high)
        freq = with_mean(mid)
        share = freq[:hot_count].sum() / freq.sum()
        low, high = (mid, high) if share < hot_mass_share else (low, mid)
    return with_mean(0.5 * (low + high))


def synthetic_profile(config: ModelConfig, setting: PaperSetting, seed: int = 0) -> Profile:
    """A Profile whose layers share the fitted frequencies, each layer in its own neuron order."""
    freq_sorted = power_law_frequencies(config.intermediate_size, setting.active_fraction,
                                        setting.hot_neuron_share, setting.hot_mass_share)
    generator = np.random.default_rng(seed)
    num_layers, width = config.num_layers, config.intermediate_size
    hot_order = np.stack([generator.permutation(width) for _ in range(num_layers)])  # [L, F]
    neuron_freq = np.zeros((num_layers, width), dtype=np.float32)  # [L, F]
    np.put_along_axis(neuron_freq, hot_order, freq_sorted[None, :].astype(np.float32), axis=1)
    tensors = {"neuron_freq": torch.from_numpy(neuron_freq), "hot_order": torch.from_numpy(hot_order),
               "neuron_mean_abs": torch.from_numpy(neuron_freq.copy()), "thresholds": torch.zeros(num_layers),
               "layer_sparsity": torch.full((num_layers,), 1.0 - setting.active_fraction)}
    return Profile(model_fingerprint=f"modeled-{setting.name}", model_id=setting.name, activity="relu", tensors=tensors,
                   calibration={"source": "synthetic power law", "active_fraction": setting.active_fraction,
                                "hot_neuron_share": setting.hot_neuron_share, "hot_mass_share": setting.hot_mass_share})


def model_parameters(config: ModelConfig) -> int:
    d, q_dim = config.hidden_size, config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    rows = 3 if config.mlp_gated else 2
    per_layer = 2 * d * q_dim + 2 * d * kv_dim + rows * d * config.intermediate_size
    return config.num_layers * per_layer + config.vocab_size * d * (1 if config.tie_word_embeddings else 2)


def paper_predictors(config: ModelConfig, setting: PaperSetting, bytes_per_weight: float) -> PredictorInfo:
    """Predictors in every layer, sized as the paper reports, stored like the model's weights."""
    per_layer_bytes = int(setting.predictor_share_of_model * model_parameters(config) * bytes_per_weight / config.num_layers)
    predicted = min(1.0, setting.overprediction * setting.active_fraction)
    layer = LayerPredictorInfo(used=True, param_bytes=per_layer_bytes, recall=setting.predictor_recall,
                               predicted_active_fraction=predicted)
    return PredictorInfo(layers=(layer,) * config.num_layers, fingerprint=f"modeled-predictors-{setting.name}")


def model_setting(setting: PaperSetting, weight_format: str, hardware: HardwareProfile | None = None,
                  gpu_budget_bytes: int = 22 * GiB, context_tokens: int = 256, time_limit_s: float = 20.0) -> dict:
    """Plan one (model, format) pair; return the modeled numbers for the bench table."""
    hardware = hardware or load_hardware("rtx4090")
    config = setting.config
    bytes_per_weight = resolve_bytes_per_weight(weight_format)
    plan = make_plan(config, model_fingerprint=f"modeled-{setting.name}", model_id=setting.name,
                     profile=synthetic_profile(config, setting), hardware=hardware, gpu_budget_bytes=gpu_budget_bytes,
                     predictors=paper_predictors(config, setting, bytes_per_weight),
                     settings=PlanSettings(bytes_per_weight=bytes_per_weight, context_tokens=context_tokens),
                     solver=SolverSettings(time_limit_s=time_limit_s))
    modeled = plan.modeled
    return {"model": setting.name, "format": weight_format, "active_fraction": setting.active_fraction,
            "model_gb": model_parameters(config) * bytes_per_weight / 1e9,
            "layer_offload_tok_s": modeled["layer_offload_tokens_per_s"],
            "layer_offload_gpu_layers": modeled["layer_offload_gpu_layers"],
            "plan_tok_s": modeled["tokens_per_s"], "speedup": modeled["speedup_vs_layer_offload"],
            "greedy_tok_s": 1.0 / plan.solver["greedy_objective_s"],
            "solver_status": plan.solver["status"], "gap_rel": plan.solver["gap_rel"],
            "plan_time_s": plan.solver["plan_time_s"], "neurons_per_chunk": plan.solver["neurons_per_chunk"],
            "gpu_activation_share": float(np.mean([layer["gpu_activation_share"] for layer in plan.layers]))}


def paper_settings(active_fraction: float = 0.10) -> list[PaperSetting]:
    return [PaperSetting("OPT-30B", opt_30b_config(), predictor_share_of_model=0.07, active_fraction=active_fraction),
            PaperSetting("Falcon-40B", falcon_40b_config(), predictor_share_of_model=0.0868, active_fraction=active_fraction)]


def modeled_rows(time_limit_s: float = 20.0) -> list[dict]:
    """Both models x FP16 / INT4 at the default assumptions."""
    return [model_setting(setting, fmt, time_limit_s=time_limit_s)
            for fmt in ("fp16", "int4") for setting in paper_settings()]
