"""Planner inputs besides the hardware: weight formats, plan settings, activation statistics.

Example::

    settings = PlanSettings(bytes_per_weight=resolve_bytes_per_weight("int4"), context_tokens=4096)
    stats = ActivationStats.from_profile(profile, cfg)   # numpy views of the profile, checked against cfg
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.core.config import ModelConfig
from tandem.core.artifacts import fingerprint
from tandem.core.errors import ArtifactError, TandemError

if TYPE_CHECKING:
    import numpy as np

WEIGHT_FORMATS = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0625, "int4": 0.5625}
# on-disk GGUF block sizes: bytes per block / weights per block
GGUF_BYTES_PER_WEIGHT = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32,
                         "Q4_1": 20 / 32, "Q5_0": 22 / 32, "Q5_1": 24 / 32, "Q2_K": 84 / 256,
                         "Q3_K": 110 / 256, "Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256}


def resolve_bytes_per_weight(weight_format: str | float) -> float:
    """Bytes per weight for ``fp32|fp16|bf16|int8|int4`` (int8/int4 include their scales) or a number."""
    if isinstance(weight_format, (int, float)) and not isinstance(weight_format, bool):
        value = float(weight_format)
    elif isinstance(weight_format, str) and weight_format.lower() in WEIGHT_FORMATS:
        value = WEIGHT_FORMATS[weight_format.lower()]
    elif isinstance(weight_format, str) and weight_format.upper() in GGUF_BYTES_PER_WEIGHT:
        value = GGUF_BYTES_PER_WEIGHT[weight_format.upper()]
    else:
        raise TandemError(f"unknown weight format {weight_format!r} (known: {', '.join(WEIGHT_FORMATS)}, "
                          f"a GGUF type such as Q4_0, or bytes per weight)")
    if not math.isfinite(value) or not 0.0 < value <= 8.0:
        raise TandemError(f"bytes per weight must be in (0, 8], got {value}")
    return value


@dataclass(frozen=True)
class PlanSettings:
    """What shapes a plan besides model, profile, predictors, hardware and budget."""
    bytes_per_weight: float = 2.0  # weights at their quantized size; also accepts "fp16", "int4", "Q4_0", ...
    kv_bytes_per_element: float = 2.0
    context_tokens: int = 2048  # KV cache capacity; attention time is modeled at half of it (average fill)
    neurons_per_chunk: int = 64
    min_gpu_neurons_per_layer: int = 128  # a layer puts at least this many (or all) neurons on the GPU, or none
    gpu_reserve_bytes: int | None = None  # GPU buffers; None -> estimated from the shapes

    def __post_init__(self) -> None:
        object.__setattr__(self, "bytes_per_weight", resolve_bytes_per_weight(self.bytes_per_weight))
        kv_bytes = self.kv_bytes_per_element
        if isinstance(kv_bytes, bool) or not isinstance(kv_bytes, (int, float)) or not 0.0 < kv_bytes <= 8.0:
            raise TandemError(f"kv_bytes_per_element must be in (0, 8], got {self.kv_bytes_per_element}")
        for key in ("context_tokens", "neurons_per_chunk"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise TandemError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if not isinstance(self.min_gpu_neurons_per_layer, int) or self.min_gpu_neurons_per_layer < 0:
            raise TandemError(f"min_gpu_neurons_per_layer must be an integer >= 0, got {self.min_gpu_neurons_per_layer!r}")
        if self.gpu_reserve_bytes is not None and (not isinstance(self.gpu_reserve_bytes, int) or self.gpu_reserve_bytes < 0):
            raise TandemError(f"gpu_reserve_bytes must be an integer >= 0, got {self.gpu_reserve_bytes!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PlanSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_dict())


@dataclass(frozen=True)
class ActivationStats:
    """The profile numbers placement uses (numpy, float64)."""
    activity: str  # "relu": exact zeros; "threshold": |h| above a per-layer threshold
    neuron_freq: np.ndarray  # [L, F] fraction of tokens where each neuron is active
    hot_order: np.ndarray  # [L, F] neuron indices, hottest first
    expert_freq: np.ndarray | None = None  # [L, E] fraction of tokens routed to each expert
    expert_repeat: np.ndarray | None = None  # [L] share of tokens whose expert set repeats the previous one

    @classmethod
    def from_profile(cls, profile: Any, config: ModelConfig) -> "ActivationStats":
        tensors = profile.tensors
        stats = cls(activity=profile.activity,
                    neuron_freq=tensors["neuron_freq"].double().numpy(),
                    hot_order=tensors["hot_order"].long().numpy(),
                    expert_freq=tensors["expert_freq"].double().numpy() if "expert_freq" in tensors else None,
                    expert_repeat=tensors["expert_repeat"].double().numpy() if "expert_repeat" in tensors else None)
        stats.check(config)
        return stats

    def check(self, config: ModelConfig) -> None:
        import numpy as np  # here, not at the top: `tandem --help` imports this module's WEIGHT_FORMATS (cold start)
        num_layers = config.num_layers
        dense_layers = [i for i in range(num_layers) if not config.is_moe_layer(i)]
        if self.neuron_freq.ndim != 2 or self.neuron_freq.shape[0] != num_layers:
            raise ArtifactError(f"profile neuron_freq has shape {list(self.neuron_freq.shape)}, the model has {num_layers} layers")
        if dense_layers:
            expected = (num_layers, config.intermediate_size)
            if self.neuron_freq.shape != expected or self.hot_order.shape != expected:
                raise ArtifactError(f"profile has {self.neuron_freq.shape[1]} FFN neurons per layer, the model has "
                                    f"{config.intermediate_size}: it was made for another model")
            freq = self.neuron_freq[dense_layers]
            if not np.all(np.isfinite(freq)) or freq.min() < 0 or freq.max() > 1:
                raise ArtifactError("profile neuron_freq must hold fractions in [0, 1]")
            ordered = np.sort(self.hot_order[dense_layers], axis=1)
            if not np.array_equal(ordered, np.broadcast_to(np.arange(config.intermediate_size), ordered.shape)):
                raise ArtifactError("profile hot_order rows must each be a permutation of the layer's neurons")
        if config.is_moe:
            if self.expert_freq is None or self.expert_freq.shape != (num_layers, config.num_experts):
                raise ArtifactError(f"profile lacks expert statistics [{num_layers}, {config.num_experts}] for this MoE model")
            if not np.all(np.isfinite(self.expert_freq)) or self.expert_freq.min() < 0 or self.expert_freq.max() > 1:
                raise ArtifactError("profile expert_freq must hold fractions in [0, 1]")


def checkpoint_bytes_per_weight(checkpoint: Any) -> float:
    """Size-weighted bytes per weight of the checkpoint's layer matrices (fp16 when unknown)."""
    total_weights, total_bytes = 0, 0.0
    for name, qtype in (checkpoint.quant_types or {}).items():
        if ".layers." not in name or not name.endswith(".weight") or qtype.upper() not in GGUF_BYTES_PER_WEIGHT:
            continue
        tensor = checkpoint.tensors.get(name)
        if tensor is None or tensor.dim() != 2:
            continue
        total_weights += tensor.numel()
        total_bytes += tensor.numel() * GGUF_BYTES_PER_WEIGHT[qtype.upper()]
    return total_bytes / total_weights if total_weights else WEIGHT_FORMATS["fp16"]
