"""The modeled per-token decode time of a placement, and of the baselines it is compared with.

Decode at batch 1 is memory-bound: a unit costs ``max(bytes read / bandwidth, flops / matmul rate)``
on the device that holds it. Per layer: attention (weights + KV reads) and the predictor run first;
then the FFN's GPU part and CPU part run concurrently, so the FFN costs the larger of the two, plus
one synchronisation when the layer uses both devices. FFN chunks read what the exact path (or the
predictor) touches, weighted by activation frequency; MoE experts by selection frequency, cache hit
rate and, on a miss, the cheaper of copying over host-to-device or computing on the CPU.

Example::

    placement = all_cpu_placement(problem)
    evaluate_placement(problem, placement).tokens_per_s
    layer_offload_estimate(problem).tokens_per_s       # llama.cpp-style, same budget
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from tandem.core.config import ModelConfig, kv_row_bytes
from tandem.core.roofline import roofline_seconds

if TYPE_CHECKING:
    from .hardware import HardwareProfile
    from .problem import PlacementProblem


# --- device time primitives ------------------------------------------------------------------
def weight_seconds(read_bytes, bytes_per_weight: float, bandwidth: float, flops: float):
    """Time to stream ``read_bytes`` of weights and do 2 flops per weight (scalar or numpy array)."""
    return roofline_seconds(read_bytes, 2.0 * (np.asarray(read_bytes, float) / bytes_per_weight), bandwidth, flops)


# Kernels per unit of the GPU step (online/gpu/layer_actions.py), each costing the profile's gpu_launch_s
ATTENTION_LAUNCHES = 4  # q/k/v with the norm, rope + KV write, attention, o + residual
FFN_LAUNCHES = 2  # gate/up + activation with the norm, down into the residual
MERGE_LAUNCHES = 1  # a layer using both devices: the CPU's output added on the GPU
HEAD_LAUNCHES = EMBEDDING_LAUNCHES = 1


def launch_seconds(launches: int, hw: "HardwareProfile") -> float:
    """GPU-step kernel latency of ``launches`` kernels (0 without a GPU or a measured ``gpu_launch_s``)."""
    return launches * hw.gpu_launch_s if hw.has_gpu else 0.0


def gpu_weight_seconds(read_bytes, bytes_per_weight: float, hw: "HardwareProfile"):
    if not hw.has_gpu:  # never placed on a GPU; keep the numbers finite
        return cpu_weight_seconds(read_bytes, bytes_per_weight, hw)
    return weight_seconds(read_bytes, bytes_per_weight, hw.gpu_bandwidth_bytes_per_s, hw.gpu_matmul_flops)


def cpu_weight_seconds(read_bytes, bytes_per_weight: float, hw: "HardwareProfile"):
    return weight_seconds(read_bytes, bytes_per_weight, hw.cpu_bandwidth_bytes_per_s, hw.cpu_matmul_flops)


def attention_kv_seconds(config: ModelConfig, attended_tokens: float, kv_bytes_per_element: float,
                         bandwidth: float, flops: float) -> float:
    """Reading K and V of ``attended_tokens`` positions and the two attention products, one layer."""
    if bandwidth <= 0 or flops <= 0:
        bandwidth, flops = 1.0, 1.0  # only reached for a GPU that does not exist; never placed there
    kv_read_bytes = kv_row_bytes(config, kv_bytes_per_element) * attended_tokens
    kv_flops = 4 * config.num_heads * config.head_dim * attended_tokens
    return roofline_seconds(kv_read_bytes, kv_flops, bandwidth, flops)


# --- placements ------------------------------------------------------------------------------
@dataclass
class Placement:
    """Which units are on the GPU. Per-layer lists are indexed by layer."""
    attention_on_gpu: list[bool]
    predictor_on_gpu: list[bool]  # False for layers without a predictor
    gpu_chunks: list[np.ndarray]  # per layer, bool per chunk (empty in MoE layers)
    expert_option: list[int]  # per layer, index into LayerUnits.expert_options (0 in dense layers)
    shared_expert_on_gpu: list[bool]
    output_head_on_gpu: bool = False
    embeddings_on_gpu: bool = False  # with tied embeddings this follows output_head_on_gpu


def all_cpu_placement(problem: "PlacementProblem") -> Placement:
    layers = problem.layers
    cpu_option = [next(k for k, o in enumerate(layer.expert_options) if o.pinned_count == 0 and o.cache_slots == 0)
                  if layer.is_moe else 0 for layer in layers]
    return Placement(attention_on_gpu=[False] * len(layers), predictor_on_gpu=[False] * len(layers),
                     gpu_chunks=[np.zeros(layer.num_chunks, dtype=bool) for layer in layers],
                     expert_option=cpu_option, shared_expert_on_gpu=[False] * len(layers))


@dataclass
class LayerTime:
    attention_s: float
    predictor_s: float
    ffn_gpu_s: float
    ffn_cpu_s: float
    sync_s: float
    gpu_neurons: int
    gpu_activation_share: float  # share of the layer's activation (or expert selection) mass served on the GPU

    @property
    def ffn_s(self) -> float:
        return max(self.ffn_gpu_s, self.ffn_cpu_s)

    @property
    def total_s(self) -> float:
        return self.attention_s + self.predictor_s + self.ffn_s + self.sync_s


@dataclass
class Evaluation:
    layers: list[LayerTime]
    output_head_s: float
    embeddings_s: float
    gpu_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    min_rule_violations: list[int] = field(default_factory=list)  # layers breaking minimum-or-none

    @property
    def time_per_token_s(self) -> float:
        return sum(layer.total_s for layer in self.layers) + self.output_head_s + self.embeddings_s

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.time_per_token_s

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu_bytes_by_kind.values())


def evaluate_layer(layer, layer_sync_s: float, attention_on_gpu: bool, predictor_on_gpu: bool,
                   gpu_chunks: np.ndarray, expert_option: int, shared_expert_on_gpu: bool) -> tuple[LayerTime, dict[str, int], bool]:
    """One layer's modeled time, its GPU bytes by kind, and whether it breaks the minimum-or-none rule."""
    kinds = {"attention_and_kv": 0, "predictors": 0, "ffn_neurons": 0, "experts": 0, "shared_experts": 0}
    uses_gpu, uses_cpu, violation = False, False, False
    attention_gpu = bool(attention_on_gpu)
    attention_s = layer.attention.gpu_s if attention_gpu else layer.attention.cpu_s
    kinds["attention_and_kv"] = layer.attention.gpu_bytes if attention_gpu else 0
    uses_gpu |= attention_gpu
    uses_cpu |= not attention_gpu
    predictor_s = 0.0
    if layer.predictor is not None:
        # the predictor gates the cold rows: with every neuron on the GPU the runtime never runs it (on the GPU
        # it is still charged: placed there, it is read for nothing)
        predictor_gpu = bool(predictor_on_gpu)
        cold_rows = not np.asarray(gpu_chunks, dtype=bool).all()
        predictor_s = layer.predictor.gpu_s if predictor_gpu else (layer.predictor.cpu_s if cold_rows else 0.0)
        kinds["predictors"] = layer.predictor.gpu_bytes if predictor_gpu else 0
        uses_gpu |= predictor_gpu
        uses_cpu |= not predictor_gpu and cold_rows
    ffn_gpu_s = ffn_cpu_s = 0.0
    gpu_neurons, share = 0, 0.0
    if layer.is_moe:
        option = layer.expert_options[expert_option]
        ffn_gpu_s, ffn_cpu_s = option.gpu_s, option.cpu_s
        kinds["experts"] = option.gpu_bytes
        uses_gpu |= option.uses_gpu
        uses_cpu |= option.uses_cpu
        share = option.gpu_share
        if layer.shared_expert is not None:
            shared_gpu = bool(shared_expert_on_gpu)
            ffn_gpu_s += layer.shared_expert.gpu_s if shared_gpu else 0.0
            ffn_cpu_s += 0.0 if shared_gpu else layer.shared_expert.cpu_s
            kinds["shared_experts"] = layer.shared_expert.gpu_bytes if shared_gpu else 0
            uses_gpu |= shared_gpu
            uses_cpu |= not shared_gpu
    else:
        on_gpu = np.asarray(gpu_chunks, dtype=bool)
        ffn_gpu_s = float(layer.chunk_gpu_s[on_gpu].sum())
        ffn_cpu_s = float(layer.chunk_cpu_s[~on_gpu].sum())
        kinds["ffn_neurons"] = int(layer.chunk_gpu_bytes[on_gpu].sum())
        gpu_neurons = int(layer.chunk_sizes[on_gpu].sum())
        total_mass = float(layer.chunk_activation_mass.sum())
        share = float(layer.chunk_activation_mass[on_gpu].sum()) / total_mass if total_mass > 0 else 0.0
        uses_gpu |= bool(on_gpu.any())
        uses_cpu |= bool((~on_gpu).any())
        violation = 0 < gpu_neurons < layer.min_gpu_neurons
        if on_gpu.any():  # the hot rows' kernels
            ffn_gpu_s += layer.ffn_launch_s
    sync_s = layer_sync_s if (uses_gpu and uses_cpu) else 0.0
    if not layer.is_moe and uses_gpu and not np.asarray(gpu_chunks, dtype=bool).all():
        sync_s += layer.merge_launch_s  # the CPU's cold rows added on the GPU, after both parts
    time = LayerTime(attention_s=attention_s, predictor_s=predictor_s, ffn_gpu_s=ffn_gpu_s, ffn_cpu_s=ffn_cpu_s,
                     sync_s=sync_s, gpu_neurons=gpu_neurons, gpu_activation_share=share)
    return time, kinds, violation


def layer_uses_gpu(placement: Placement, i: int) -> bool:
    """A dense layer with any unit on the GPU."""
    return bool(placement.attention_on_gpu[i] or placement.predictor_on_gpu[i]
                or np.asarray(placement.gpu_chunks[i], dtype=bool).any())


def cpu_run_starts(problem: "PlacementProblem", placement: Placement) -> list[int]:
    """Dense all-CPU layers that begin a run of them (after a layer that used the GPU, a MoE layer, or at
    the start): the runtime makes one host call (a fused C call) per run."""
    layers = problem.layers
    return [i for i, layer in enumerate(layers) if not layer.is_moe and not layer_uses_gpu(placement, i)
            and (i == 0 or layers[i - 1].is_moe or layer_uses_gpu(placement, i - 1))]


def head_after_gpu(problem: "PlacementProblem", placement: Placement) -> bool:
    """The output layer on the CPU right after a dense layer that used the GPU: the runtime fetches the
    residual stream (a sync) and makes a host call of its own for it (else it ends the last CPU run's call)."""
    last = len(problem.layers) - 1
    return (not placement.output_head_on_gpu and last >= 0 and not problem.layers[last].is_moe
            and layer_uses_gpu(placement, last))


def entered_cpu_layers(problem: "PlacementProblem", placement: Placement) -> list[int]:
    """Dense layers all on the CPU that the residual stream reaches from the GPU: the runtime fetches it
    there (one sync), after a layer that used the GPU or, for the first layer, after the GPU's embedding.
    Runs of CPU layers pay once (the fused C step runs them in one call)."""
    emb_gpu = placement.output_head_on_gpu if problem.embeddings is None else placement.embeddings_on_gpu
    return [i for i in cpu_run_starts(problem, placement)  # a start after a dense layer follows one using the GPU
            if (i == 0 and emb_gpu) or (i > 0 and not problem.layers[i - 1].is_moe)]


def evaluate_placement(problem: "PlacementProblem", placement: Placement) -> Evaluation:
    """Modeled time per token and GPU bytes of ``placement`` (the reference the ILP must agree with)."""
    kinds = dict.fromkeys(("buffers", "attention_and_kv", "predictors", "ffn_neurons", "experts",
                           "shared_experts", "output_head", "embeddings"), 0)
    kinds["buffers"] = problem.buffer_bytes
    layer_times, violations = [], []
    for i, layer in enumerate(problem.layers):
        time, layer_kinds, violation = evaluate_layer(
            layer, problem.mixed_layer_s, placement.attention_on_gpu[i], placement.predictor_on_gpu[i],
            placement.gpu_chunks[i], placement.expert_option[i], placement.shared_expert_on_gpu[i])
        layer_times.append(time)
        for key, value in layer_kinds.items():
            kinds[key] += value
        if violation:
            violations.append(i)
    for i in entered_cpu_layers(problem, placement):
        layer_times[i] = replace(layer_times[i], sync_s=layer_times[i].sync_s + problem.layer_sync_s)
    for i in cpu_run_starts(problem, placement):
        layer_times[i] = replace(layer_times[i], sync_s=layer_times[i].sync_s + problem.cpu_call_s)
    head = problem.output_head
    output_head_s = head.gpu_s if placement.output_head_on_gpu else head.cpu_s
    if head_after_gpu(problem, placement):
        output_head_s += problem.layer_sync_s + problem.cpu_call_s
    kinds["output_head"] = head.gpu_bytes if placement.output_head_on_gpu else 0
    embeddings_s = 0.0
    if problem.embeddings is not None:
        emb = problem.embeddings
        embeddings_s = emb.gpu_s if placement.embeddings_on_gpu else emb.cpu_s
        kinds["embeddings"] = emb.gpu_bytes if placement.embeddings_on_gpu else 0
    return Evaluation(layers=layer_times, output_head_s=output_head_s, embeddings_s=embeddings_s,
                      gpu_bytes_by_kind=kinds, min_rule_violations=violations)


# --- baselines ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerOffloadEstimate:
    """llama.cpp-style: whole layers (dense) on the GPU until the budget is full."""
    gpu_layers: int
    output_head_on_gpu: bool
    gpu_bytes: int
    time_per_token_s: float

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.time_per_token_s


def layer_offload_estimate(problem: "PlacementProblem") -> LayerOffloadEstimate:
    """Dense execution; the last ``gpu_layers`` layers (weights + KV) on the GPU, the output head too
    when every layer fits (llama.cpp's ``-ngl``); one synchronisation per CPU/GPU hand-over."""
    layers = problem.layers
    capacity = problem.capacity_bytes if problem.hardware.has_gpu and problem.gpu_budget_bytes > 0 else 0
    layer_bytes = [layer.attention.gpu_bytes + layer.dense_ffn.gpu_bytes for layer in layers]
    used, gpu_layers = 0, 0
    for size in reversed(layer_bytes):
        if used + size > capacity:
            break
        used, gpu_layers = used + size, gpu_layers + 1
    head_on_gpu = gpu_layers == len(layers) and used + problem.output_head.gpu_bytes <= capacity
    used += problem.output_head.gpu_bytes if head_on_gpu else 0
    first_gpu_layer = len(layers) - gpu_layers
    time_s = 0.0
    for i, layer in enumerate(layers):
        on_gpu = i >= first_gpu_layer
        time_s += (layer.attention.gpu_s + layer.dense_ffn.gpu_s) if on_gpu else (layer.attention.cpu_s + layer.dense_ffn.cpu_s)
    time_s += problem.output_head.gpu_s if head_on_gpu else problem.output_head.cpu_s
    if problem.embeddings is not None:
        time_s += problem.embeddings.cpu_s
    devices = ["cpu"] + ["gpu" if i >= first_gpu_layer else "cpu" for i in range(len(layers))] + ["gpu" if head_on_gpu else "cpu"]
    hand_overs = sum(1 for a, b in zip(devices, devices[1:]) if a != b)
    time_s += hand_overs * problem.hardware.layer_sync_latency_s
    on = devices[1:]  # the layers' and the head's devices
    host_calls = sum(1 for i, dev in enumerate(on) if dev == "cpu" and (i == 0 or on[i - 1] != "cpu"))  # CPU runs
    time_s += host_calls * problem.cpu_call_s
    return LayerOffloadEstimate(gpu_layers=gpu_layers, output_head_on_gpu=head_on_gpu,
                                gpu_bytes=used + (problem.buffer_bytes if gpu_layers else 0), time_per_token_s=time_s)


def all_cpu_dense_seconds(problem: "PlacementProblem") -> float:
    """Every weight read on the CPU, no sparsity (llama.cpp without a GPU)."""
    time_s = sum(layer.attention.cpu_s + layer.dense_ffn.cpu_s for layer in problem.layers)
    time_s += problem.output_head.cpu_s
    return time_s + (problem.embeddings.cpu_s if problem.embeddings is not None else 0.0)


def all_cpu_sparse_seconds(problem: "PlacementProblem") -> float:
    """This engine on the CPU alone (exact path / predictors, no GPU)."""
    return evaluate_placement(problem, all_cpu_placement(problem)).time_per_token_s
