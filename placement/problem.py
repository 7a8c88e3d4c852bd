"""The placement problem: every unit that can live on the GPU, its size and its modeled time.

Units per layer: the attention block (weights + KV cache), the layer's predictor, FFN neuron
chunks (hottest first) or, in MoE layers, the expert options (pinned count x LRU cache slots) and
the shared expert; once per model: the output head and the embeddings. ``build_problem`` turns a
config, activation statistics, predictor facts and a hardware profile into these numbers, which
both the greedy baseline and the ILP optimise, and which ``cost_model.evaluate_placement`` scores.

Example::

    settings = PlanSettings(bytes_per_weight=resolve_bytes_per_weight("int4"))
    problem = build_problem(cfg, ActivationStats.from_profile(profile, cfg), no_predictors(cfg.num_layers),
                            load_hardware("rtx4090"), gpu_budget_bytes=2 * 2**30, settings=settings)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.core.config import ModelConfig
from tandem.core.errors import TandemError
from tandem.core.tier_format import expert_file_blocks, expert_format_for, expert_layout_bytes, tier_matrix_bytes

from . import cost_model
from .expert_cache_model import lru_hit_rate
from .hardware import MiB, HardwareProfile
from .predictor_info import PredictorInfo
from .settings import ActivationStats, PlanSettings

GPU_WORKSPACE_BYTES = 8 * MiB  # cuBLAS-style workspace + allocator slack reserved in every GPU budget
INDEX_BYTES_PER_GPU_NEURON = 8  # int64 entry of the GPU-row -> neuron index map
BIAS_BYTES = 4  # float32 up/gate bias entries of a hot neuron (models with FFN biases)


@dataclass(frozen=True)
class DenseUnit:
    """A block placed whole: bytes it takes on the GPU and its time on either device."""
    gpu_bytes: int
    gpu_s: float
    cpu_s: float


@dataclass(frozen=True)
class ExpertOption:
    """One MoE layer choice: the ``pinned_count`` most popular experts pinned + ``cache_slots`` LRU slots."""
    pinned_count: int
    cache_slots: int
    gpu_bytes: int
    gpu_s: float  # pinned + cache hits (+ misses copied over, when copying beats CPU compute)
    cpu_s: float  # misses computed on the CPU (Fiddler-style)
    gpu_share: float  # expected share of expert computations done on the GPU
    uses_gpu: bool
    uses_cpu: bool


@dataclass
class LayerUnits:
    index: int
    is_moe: bool
    attention: DenseUnit  # weights + KV cache for the configured context (+ router in MoE layers)
    predictor: DenseUnit | None  # None when the layer runs the exact path
    dense_ffn: DenseUnit  # the whole FFN computed densely (for layer-offload baselines)
    # dense FFN layers: chunks of neurons in hot order (empty arrays in MoE layers)
    chunk_neurons: list[np.ndarray] = field(default_factory=list)
    chunk_gpu_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_gpu_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    chunk_cpu_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    chunk_activation_mass: np.ndarray = field(default_factory=lambda: np.zeros(0))
    min_gpu_neurons: int = 0  # effective minimum-or-none threshold (capped at the layer's width)
    ffn_launch_s: float = 0.0  # GPU-step kernels of the FFN's hot rows (cost_model.FFN_LAUNCHES), once per layer
    merge_launch_s: float = 0.0  # ... and of merging the CPU's rows when the layer uses both devices
    # MoE layers
    expert_options: list[ExpertOption] = field(default_factory=list)
    expert_popularity_order: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    shared_expert: DenseUnit | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_neurons)

    @property
    def chunk_sizes(self) -> np.ndarray:
        return np.array([len(c) for c in self.chunk_neurons], dtype=np.int64)


@dataclass
class PlacementProblem:
    config: ModelConfig
    hardware: HardwareProfile
    settings: PlanSettings
    gpu_budget_bytes: int
    buffer_bytes: int  # GPU buffers reserved out of the budget
    neurons_per_chunk: int  # effective chunk size (may be coarser than requested for huge models)
    layers: list[LayerUnits]
    output_head: DenseUnit  # with tied embeddings this unit is the shared table (lookup time included)
    embeddings: DenseUnit | None  # None when tied to the output head
    layer_sync_s: float
    cpu_call_s: float = 0.0  # per host call of the GPU step's CPU share (cost_model.cpu_run_starts)

    @property
    def mixed_layer_s(self) -> float:
        """What a layer using both devices pays beyond its units: the exchange and the host's call."""
        return self.layer_sync_s + self.cpu_call_s

    @property
    def capacity_bytes(self) -> int:
        """Bytes left for placed units once buffers are reserved."""
        return max(self.gpu_budget_bytes - self.buffer_bytes, 0)


def estimate_buffer_bytes(config: ModelConfig, settings: PlanSettings) -> int:
    """fp32 activation, logits and FFN buffers for batch 1, plus a fixed workspace."""
    if settings.gpu_reserve_bytes is not None:
        return settings.gpu_reserve_bytes
    ffn_width = max(config.intermediate_size,
                    config.num_experts_per_tok * config.moe_intermediate_size + config.shared_expert_intermediate_size)
    activations = 2 * config.vocab_size + 8 * config.hidden_size + 4 * ffn_width
    return 4 * activations + GPU_WORKSPACE_BYTES


def effective_chunk_size(config: ModelConfig, neurons_per_chunk: int, max_total_chunks: int) -> int:
    """Double the chunk size until the model has at most ``max_total_chunks`` FFN chunks."""
    dense_layers = sum(1 for i in range(config.num_layers) if not config.is_moe_layer(i))
    size = neurons_per_chunk
    while dense_layers * math.ceil(config.intermediate_size / size) > max_total_chunks and size < config.intermediate_size:
        size *= 2
    return size


def _unit(num_bytes: int, read_bytes: float, hw: HardwareProfile, bpw: float, launches: int = 0) -> DenseUnit:
    return DenseUnit(gpu_bytes=int(num_bytes),
                     gpu_s=cost_model.gpu_weight_seconds(read_bytes, bpw, hw) + cost_model.launch_seconds(launches, hw),
                     cpu_s=cost_model.cpu_weight_seconds(read_bytes, bpw, hw))


def _neuron_read_rows(config: ModelConfig, activity: str, freq: np.ndarray, predictor: Any) -> np.ndarray:
    """Expected weight rows read per token for each neuron (gate/up/down rows of one neuron)."""
    rows_total = 3 if config.mlp_gated else 2
    if predictor is not None and predictor.used:
        mean_freq = float(freq.mean()) if freq.size else 0.0
        recall = predictor.recall
        false_positive_rate = 0.0
        if mean_freq < 1.0:
            false_positive_rate = (predictor.predicted_active_fraction - recall * mean_freq) / (1.0 - mean_freq)
        false_positive_rate = min(max(false_positive_rate, 0.0), 1.0)
        predicted_active = np.clip(recall * freq + false_positive_rate * (1.0 - freq), 0.0, 1.0)
        return rows_total * predicted_active
    # exact path: the first projection in full (gate and up for SwiGLU-style thresholds), the rest sparse
    rows_always = 2 if (config.mlp_gated and activity != "relu") else 1
    return rows_always + (rows_total - rows_always) * freq


def _expert_options(config: ModelConfig, hw: HardwareProfile, bpw: float, expert_freq: np.ndarray, repeat_rate: float,
                    gpu_enabled: bool, file_blocks: str | None = None) -> tuple[list[ExpertOption], np.ndarray]:
    rows = 3 if config.mlp_gated else 2
    expert_bytes = math.ceil(rows * config.hidden_size * config.moe_intermediate_size * bpw)
    # a cache slot holds one expert as the runtime packs it (one buffer, its own format and alignment)
    slot_bytes = expert_layout_bytes(config.hidden_size, config.moe_intermediate_size, config.mlp_gated,
                                     expert_format_for(bpw), bias=config.mlp_bias, file_blocks=file_blocks)
    gpu_s = cost_model.gpu_weight_seconds(expert_bytes, bpw, hw)
    cpu_s = cost_model.cpu_weight_seconds(expert_bytes, bpw, hw)
    copy_s = slot_bytes / hw.h2d_bandwidth_bytes_per_s if hw.h2d_bandwidth_bytes_per_s > 0 else math.inf
    order = np.argsort(-expert_freq, kind="stable")
    freq_sorted = expert_freq[order]
    num_experts = len(expert_freq)
    if not gpu_enabled:
        grid = [(0, 0)]
    elif num_experts <= 16:
        grid = [(m, s) for m in range(num_experts + 1) for s in range(num_experts - m + 1)]
    else:
        steps = sorted({0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, num_experts})
        grid = [(m, s) for m in steps if m <= num_experts for s in steps if s <= num_experts - m]
    options = []
    for pinned, slots in grid:
        pinned_mass = float(freq_sorted[:pinned].sum())
        unpinned = freq_sorted[pinned:]
        unpinned_mass = float(unpinned.sum())
        hit = lru_hit_rate(unpinned, slots, repeat_rate)
        miss_mass = unpinned_mass * (1.0 - hit)
        option_gpu = (pinned_mass + unpinned_mass * hit) * gpu_s
        option_cpu = 0.0
        copy_instead = slots > 0 and copy_s + gpu_s < cpu_s
        if copy_instead:
            option_gpu += miss_mass * (copy_s + gpu_s)
        else:
            option_cpu = miss_mass * cpu_s
        total_mass = pinned_mass + unpinned_mass
        on_gpu_mass = pinned_mass + unpinned_mass * hit + (miss_mass if copy_instead else 0.0)
        options.append(ExpertOption(pinned_count=pinned, cache_slots=slots, gpu_bytes=(pinned + slots) * slot_bytes,
                                    gpu_s=option_gpu, cpu_s=option_cpu,
                                    gpu_share=on_gpu_mass / total_mass if total_mass > 0 else 0.0,
                                    uses_gpu=pinned + slots > 0, uses_cpu=option_cpu > 0))
    return options, order


def build_problem(config: ModelConfig, stats: ActivationStats, predictors: PredictorInfo,
                  hardware: HardwareProfile, gpu_budget_bytes: int, settings: PlanSettings,
                  max_total_chunks: int = 40_000) -> PlacementProblem:
    """Sizes and modeled times of every placeable unit (see the module docstring)."""
    if predictors.num_layers != config.num_layers:
        raise TandemError(f"predictor info has {predictors.num_layers} layers, the model has {config.num_layers}")
    stats.check(config)
    hw, bpw, d = hardware, settings.bytes_per_weight, config.hidden_size
    gpu_enabled = hardware.has_gpu and gpu_budget_bytes > 0
    chunk_size = effective_chunk_size(config, settings.neurons_per_chunk, max_total_chunks)
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    fmt = settings.format_of  # each tensor (role, layer) in the plan's format for it (GGUF blocks as they are)
    kv_cache_bytes = math.ceil(2 * kv_dim * settings.context_tokens * settings.kv_bytes_per_element)
    attention_bias_bytes = BIAS_BYTES * ((q_dim + 2 * kv_dim if config.attention_bias else 0)
                                         + (d if config.attention_out_bias else 0))
    attended_tokens = settings.context_tokens / 2
    rows_total = 3 if config.mlp_gated else 2
    bias_rows = (rows_total - 1) if config.mlp_bias else 0  # up (+ gate) biases; the down bias is per layer
    neuron_roles = ("ffn_up", "ffn_down") + (("ffn_gate",) if config.mlp_gated else ())
    layers = []
    for i in range(config.num_layers):
        is_moe = config.is_moe_layer(i)
        attention_matrices_bytes = (tier_matrix_bytes(q_dim, d, fmt("attn_q", i)) + tier_matrix_bytes(kv_dim, d, fmt("attn_k", i))
                                    + tier_matrix_bytes(kv_dim, d, fmt("attn_v", i)) + tier_matrix_bytes(d, q_dim, fmt("attn_o", i)))
        neuron_weight_bytes = sum(tier_matrix_bytes(1, d, fmt(role, i)) for role in neuron_roles)  # one row of each
        neuron_bytes = neuron_weight_bytes + INDEX_BYTES_PER_GPU_NEURON + BIAS_BYTES * bias_rows
        weight_bytes = attention_matrices_bytes + (math.ceil(config.num_experts * d * bpw) if is_moe else 0)
        # on the tier: q/k/v/o in the plan's formats, fp32 biases, the KV cache (the router stays with the experts)
        attention_tier_bytes = attention_matrices_bytes + attention_bias_bytes
        attention = DenseUnit(
            gpu_bytes=attention_tier_bytes + kv_cache_bytes,
            gpu_s=cost_model.gpu_weight_seconds(weight_bytes, bpw, hw) + cost_model.attention_kv_seconds(config, attended_tokens, settings.kv_bytes_per_element, hw.gpu_bandwidth_bytes_per_s, hw.gpu_matmul_flops)
            + cost_model.launch_seconds(cost_model.ATTENTION_LAUNCHES, hw),
            cpu_s=cost_model.cpu_weight_seconds(weight_bytes, bpw, hw) + cost_model.attention_kv_seconds(config, attended_tokens, settings.kv_bytes_per_element, hw.cpu_bandwidth_bytes_per_s, hw.cpu_matmul_flops))
        info = predictors.layers[i]
        predictor = None
        if info.used and not is_moe:
            # the runtime scores a layer's cold rows on the host, where they run (the GPU step's C call:
            # online/gpu/cpu_runs.py), whatever the plan says: on the GPU a predictor saves no time
            host = _unit(info.param_bytes, info.param_bytes, hw, bpw)
            predictor = DenseUnit(gpu_bytes=host.gpu_bytes, gpu_s=host.cpu_s, cpu_s=host.cpu_s)
        if is_moe:
            ffn_weights = rows_total * d * (config.num_experts * config.moe_intermediate_size + config.shared_expert_intermediate_size)
            read_weights = rows_total * d * (config.num_experts_per_tok * config.moe_intermediate_size + config.shared_expert_intermediate_size)
            dense_ffn = DenseUnit(math.ceil(ffn_weights * bpw), *_read_seconds(read_weights * bpw, bpw, hw))
            repeat = float(stats.expert_repeat[i]) if stats.expert_repeat is not None else 0.0
            in_blocks = expert_file_blocks(expert_format_for(bpw), settings.explicit_format("experts", i))
            options, order = _expert_options(config, hw, bpw, stats.expert_freq[i], repeat, gpu_enabled, in_blocks)
            shared = None
            if config.shared_expert_intermediate_size:  # as the tier stores it: rows, down as it is, fp32 gate vector
                width_s = config.shared_expert_intermediate_size
                shared_bytes = (tier_matrix_bytes(width_s, d, fmt("ffn_up", i)) + tier_matrix_bytes(d, width_s, fmt("ffn_down", i))
                                + (tier_matrix_bytes(width_s, d, fmt("ffn_gate", i)) if config.mlp_gated else 0)
                                + BIAS_BYTES * d)
                shared = _unit(shared_bytes, shared_bytes, hw, bpw)
            layers.append(LayerUnits(index=i, is_moe=True, attention=attention, predictor=None, dense_ffn=dense_ffn,
                                     expert_options=options, expert_popularity_order=order, shared_expert=shared))
            continue
        width = config.intermediate_size
        dense_bytes = width * neuron_weight_bytes
        dense_ffn = _unit(dense_bytes, dense_bytes, hw, bpw, cost_model.FFN_LAUNCHES)
        freq = stats.neuron_freq[i]
        read_rows = _neuron_read_rows(config, stats.activity, freq, info)  # [F]
        order = stats.hot_order[i]
        chunks = [order[start:start + chunk_size] for start in range(0, width, chunk_size)]
        chunk_rows = np.array([read_rows[c].sum() for c in chunks])
        chunk_read_bytes = chunk_rows * neuron_weight_bytes / len(neuron_roles)
        layers.append(LayerUnits(
            index=i, is_moe=False, attention=attention, predictor=predictor, dense_ffn=dense_ffn,
            chunk_neurons=chunks,
            chunk_gpu_bytes=np.array([len(c) * neuron_bytes for c in chunks], dtype=np.int64),
            chunk_gpu_s=cost_model.gpu_weight_seconds(chunk_read_bytes, bpw, hw),
            chunk_cpu_s=cost_model.cpu_weight_seconds(chunk_read_bytes, bpw, hw),
            chunk_activation_mass=np.array([freq[c].sum() for c in chunks]),
            min_gpu_neurons=min(settings.min_gpu_neurons_per_layer, width),
            ffn_launch_s=cost_model.launch_seconds(cost_model.FFN_LAUNCHES, hw),
            merge_launch_s=cost_model.launch_seconds(cost_model.MERGE_LAUNCHES, hw)))
    head_bytes = tier_matrix_bytes(config.vocab_size, d, fmt("output"))
    if config.tie_word_embeddings:
        output_head = _unit(head_bytes, head_bytes + head_bytes / config.vocab_size, hw, bpw, cost_model.HEAD_LAUNCHES)
        embeddings = None
    else:
        table_bytes = tier_matrix_bytes(config.vocab_size, d, fmt("embeddings"))
        output_head = _unit(head_bytes, head_bytes, hw, bpw, cost_model.HEAD_LAUNCHES)
        embeddings = _unit(table_bytes, table_bytes / config.vocab_size, hw, bpw, cost_model.EMBEDDING_LAUNCHES)
    return PlacementProblem(config=config, hardware=hardware, settings=settings, gpu_budget_bytes=int(gpu_budget_bytes),
                            buffer_bytes=estimate_buffer_bytes(config, settings) if gpu_enabled else 0,
                            neurons_per_chunk=chunk_size, layers=layers, output_head=output_head, embeddings=embeddings,
                            layer_sync_s=hardware.layer_sync_latency_s if gpu_enabled else 0.0,
                            cpu_call_s=hardware.cpu_call_s if gpu_enabled else 0.0)


def _read_seconds(read_bytes: float, bpw: float, hw: HardwareProfile) -> tuple[float, float]:
    return cost_model.gpu_weight_seconds(read_bytes, bpw, hw), cost_model.cpu_weight_seconds(read_bytes, bpw, hw)
