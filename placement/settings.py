"""Planner inputs besides the hardware: weight formats, plan settings, activation statistics.

Example::

    settings = PlanSettings(bytes_per_weight=resolve_bytes_per_weight("int4"), context_tokens=4096)
    settings = PlanSettings(bytes_per_weight=0.625, tensor_formats={"output": "q8"})  # one role in its own format
    settings.format_of("output"), settings.format_of("ffn_up")                      # ('q8', 'q4_1')
    stats = ActivationStats.from_profile(profile, cfg)   # numpy views of the profile, checked against cfg
"""
from __future__ import annotations

import dataclasses
import math
import re
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
# tensor roles a plan may give their own tier format (``PlanSettings.tensor_formats``)
TENSOR_ROLES = ("attn_q", "attn_k", "attn_v", "attn_o", "ffn_up", "ffn_gate", "ffn_down", "output", "embeddings",
                "experts")  # experts: a MoE layer's experts kept in the file's Q4_0 / Q4_1 / Q8_0 blocks
_LAYER_KEY = re.compile(r"^layers\.\d+\.")
# role -> the checkpoint tensor (``{i}``: every layer) it takes its format from
_ROLE_TENSORS = {"attn_q": "model.layers.{i}.self_attn.q_proj.weight", "attn_k": "model.layers.{i}.self_attn.k_proj.weight",
                 "attn_v": "model.layers.{i}.self_attn.v_proj.weight", "attn_o": "model.layers.{i}.self_attn.o_proj.weight",
                 "ffn_up": "model.layers.{i}.mlp.up_proj.weight", "ffn_gate": "model.layers.{i}.mlp.gate_proj.weight",
                 "ffn_down": "model.layers.{i}.mlp.down_proj.weight", "embeddings": "model.embed_tokens.weight",
                 "output": "lm_head.weight", "experts": "model.layers.{i}.mlp.experts.0.{proj}_proj.weight"}
# GGUF block type -> the tier format that holds it: as it is (F32, F16, Q8_0, Q4_0, Q4_1) or re-encoded at
# no fewer bits (5/6-bit types in q8; 2/3/4-bit k-quants, whose blocks carry a minimum, in q4_1)
GGUF_TIER_FORMAT = {"F32": "fp32", "F16": "fp16", "BF16": "fp16", "Q8_0": "q8", "Q4_0": "q4", "Q4_1": "q4_1",
                    "Q5_0": "q8", "Q5_1": "q8", "Q5_K": "q8", "Q6_K": "q8", "IQ4_NL": "q8",
                    "Q2_K": "q4_1", "Q3_K": "q4_1", "Q4_K": "q4_1"}
# the down projection is kept transposed (rows = neurons): its blocks run along the other axis and are
# re-encoded, so it goes one step more detailed than its type (re-encoding 4-bit values at 4 bits again
# doubles their error; SmolLM2 64 MiB plan: +4.1% perplexity with q4_1 down rows)
_REENCODED = {"q4": "q8", "q4_1": "q8", "q8": "fp16", "fp16": "fp16", "fp32": "fp32"}


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
    # (role or "layers.N.role", tier format) sorted pairs (TENSOR_ROLES, TIER_FORMATS); a layer's own entry wins
    # over its role's; tensors with neither use bytes_per_weight
    tensor_formats: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "bytes_per_weight", resolve_bytes_per_weight(self.bytes_per_weight))
        formats = self.tensor_formats
        pairs = formats.items() if isinstance(formats, dict) else formats
        try:
            pairs = tuple(sorted((str(role), str(fmt)) for role, fmt in pairs))
        except (TypeError, ValueError):
            raise TandemError(f"tensor_formats must map tensor roles to tier formats, got {formats!r}") from None
        from tandem.core.tier_format import TIER_FORMATS  # torch: not imported by `tandem --help`
        for key, fmt in pairs:
            role = _LAYER_KEY.sub("", key)  # "layers.3.ffn_up": that layer's tensor only
            if role not in TENSOR_ROLES or fmt not in TIER_FORMATS or (key != role and role in ("output", "embeddings")):
                raise TandemError(f"bad tensor format {key}={fmt} (keys: a role or layers.N.role; roles: "
                                  f"{', '.join(TENSOR_ROLES)}; formats: {', '.join(TIER_FORMATS)})")
        object.__setattr__(self, "tensor_formats", pairs)
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

    def format_of(self, role: str, layer: int | None = None) -> str:
        """The tier format of ``role`` (in ``layer``): its own, else the densest holding ``bytes_per_weight``."""
        from tandem.core.tier_format import format_lookup, tier_format_for
        return format_lookup(self.tensor_formats, role, layer, tier_format_for(self.bytes_per_weight))

    def explicit_format(self, role: str, layer: int | None = None) -> str | None:
        """The format ``tensor_formats`` names for ``role`` (in ``layer``), or None where it names none."""
        from tandem.core.tier_format import format_lookup
        return format_lookup(self.tensor_formats, role, layer, None)

    def bytes_of(self, role: str, layer: int | None = None) -> float:
        """Bytes per weight of ``role`` on the tier (block scales included)."""
        from tandem.core.tier_format import TIER_FORMATS
        return TIER_FORMATS[self.format_of(role, layer)]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("tensor_formats")
        if self.tensor_formats:  # left out when empty: plans made before per-tensor formats keep their fingerprint
            out["tensor_formats"] = dict(self.tensor_formats)
        return out

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


def checkpoint_tensor_formats(checkpoint: Any) -> dict[str, str]:
    """Tier formats that keep the checkpoint's GGUF blocks (``GGUF_TIER_FORMAT``): per role the format most of
    its layers' tensors have, plus ``layers.N.role`` for the layers that differ (Q4_K_M-style mixes).
    Empty for checkpoints without on-disk types.

    Example: SmolLM2 Q4_1 (Q4_1 layers, Q8_0 tied embeddings) -> ``{"ffn_up": "q4_1", ..., "output": "q8"}``.
    """
    from tandem.core.tier_format import EXPERT_FILE_BLOCKS, TIER_FORMATS
    kept_kinds = {kind for kinds in EXPERT_FILE_BLOCKS.values() for kind in kinds}  # gate, up, down all of one
    types = checkpoint.quant_types or {}
    config = checkpoint.config
    out: dict[str, str] = {}
    for role, pattern in _ROLE_TENSORS.items():
        if role == "output" and config.tie_word_embeddings:
            pattern = _ROLE_TENSORS["embeddings"]
        layers = range(config.num_layers) if "{i}" in pattern else [None]
        if role == "experts":  # the blocks where gate, up and down are all Q4_0, all Q4_1 or all Q8_0
            kinds = {i: [types.get(pattern.format(i=i, proj=p), "").upper() for p in ("gate", "up", "down")]
                     for i in layers}
            found = {i: GGUF_TIER_FORMAT[k[0]] if len(set(k)) == 1 and k[0] in kept_kinds
                     else "fp32" for i, k in kinds.items() if all(k)}  # fp32: packed from their float values
            if all(f == "fp32" for f in found.values()):
                continue  # no layer keeps its experts' blocks: no role (as before it existed)
        else:
            found = {i: GGUF_TIER_FORMAT.get(types[pattern.format(i=i)].upper(), "fp32") for i in layers
                     if pattern.format(i=i) in types}
        if role == "ffn_down":  # re-encoded along the other axis: one step more detailed
            found = {i: _REENCODED[f] for i, f in found.items()}
        if not found:
            continue
        counts = {f: list(found.values()).count(f) for f in found.values()}
        common = max(counts, key=lambda f: (counts[f], TIER_FORMATS[f]))
        out[role] = common
        out.update({f"layers.{i}.{role}": f for i, f in found.items() if f != common and i is not None})
    return out
