"""ModelConfig: the architecture description every component shares.

One frozen, validated dataclass covers the supported families:
- ``llama``: Llama, SmolLM2, Mistral, Qwen2 (RMSNorm, RoPE, GQA, gated FFN), including the
  sparse-activation variants (``hidden_act`` relu / fatrelu / drelu),
- ``opt``: LayerNorm, learned positions (offset 2), plain ReLU FFN with biases,
- ``mixtral`` / ``qwen2_moe``: Llama-style attention with top-k routed experts,
- ``qwen3``: Llama layout plus RMSNorm on q and k heads (``qk_norm``),
- ``gemma3``: q/k norms, norms on the attention and FFN outputs (``sandwich_norms``), gated GELU(tanh),
  embeddings times sqrt(d), ``attn_scale`` = query_pre_attn_scalar ** -0.5, sliding-window layers
  (``layer_windows``) with their own rope base (``rope_local_theta``) interleaved with global ones.
  Gemma's RMSNorm multiplies by (1 + w): canonical checkpoints hold the effective weight 1 + w
  (GGUF files already store it that way; the HF loader adds 1).

Example::

    cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3)
    cfg.head_dim  # 64
"""
from __future__ import annotations

import math

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.core.errors import TandemError

ARCHS = ("llama", "opt", "mixtral", "qwen2_moe", "qwen3", "gemma3")
ACTIVATIONS = ("silu", "relu", "gelu", "gelu_tanh", "fatrelu", "drelu")
ROPE_SCALING_TYPES = ("linear", "llama3", "default")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    max_context: int = 2048
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    position: str = "rope"  # "rope" | "learned"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # frozen dict items, e.g. (("rope_type","llama3"),...)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v
    attention_out_bias: bool = False  # bias on o_proj
    mlp_gated: bool = True  # act(gate x) * up x, else act(up x)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    act_threshold: float = 0.0  # FATReLU threshold
    sliding_window: int = 0  # 0 -> none
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()  # layers with experts; empty -> all layers when num_experts > 0
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # OPT: learned position offset
    position_offset: int = 0
    # Qwen3 / Gemma 3
    qk_norm: bool = False  # RMSNorm over head_dim on q and k heads, before rotary
    sandwich_norms: bool = False  # RMSNorm on the attention output and on the FFN output (Gemma)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    attn_scale: float = 0.0  # softmax scale; 0 -> head_dim ** -0.5
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0 -> none
    layer_windows: tuple[int, ...] = ()  # per-layer sliding window (0 = global); empty -> sliding_window
    rope_local_theta: float = 0.0  # rope base of windowed layers (unscaled); 0 -> rope_theta + scaling

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
        if self.num_experts > 0 and not self.moe_layers:
            object.__setattr__(self, "moe_layers", tuple(range(self.num_layers)))
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> TandemError:
            return TandemError(f"invalid model config: {msg}")
        if self.arch not in ARCHS:
            raise bad(f"unsupported architecture {self.arch!r} (supported: {', '.join(ARCHS)})")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_context"):
            if getattr(self, name) <= 0:
                raise bad(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise bad(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.norm not in ("rms", "layer"):
            raise bad(f"norm must be 'rms' or 'layer', got {self.norm!r}")
        if self.position not in ("rope", "learned"):
            raise bad(f"position must be 'rope' or 'learned', got {self.position!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise bad(f"unsupported activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.position == "rope" and self.head_dim % 2:
            raise bad("rotary embeddings need an even head_dim")
        scaling = dict(self.rope_scaling)
        if scaling and scaling.get("rope_type", scaling.get("type")) not in ROPE_SCALING_TYPES:
            raise bad(f"unsupported rope_scaling {scaling} (supported types: {', '.join(ROPE_SCALING_TYPES)})")
        if self.num_experts:
            if not (0 < self.num_experts_per_tok <= self.num_experts):
                raise bad(f"num_experts_per_tok {self.num_experts_per_tok} not in 1..{self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise bad("moe_intermediate_size must be positive for MoE models")
            if any(not 0 <= i < self.num_layers for i in self.moe_layers):
                raise bad("moe_layers out of range")
        elif self.intermediate_size <= 0:
            raise bad("intermediate_size must be positive")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise bad(f"layer_windows needs {self.num_layers} non-negative entries, got {list(self.layer_windows)}")
        if self.embed_scale <= 0 or self.attn_scale < 0 or self.final_logit_softcap < 0 or self.rope_local_theta < 0:
            raise bad("embed_scale must be positive; attn_scale, final_logit_softcap, rope_local_theta >= 0")
        for name in ("norm_eps", "rope_theta", "embed_scale", "attn_scale", "final_logit_softcap", "rope_local_theta",
                     "act_threshold"):
            if not math.isfinite(getattr(self, name)):
                raise bad(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.norm_eps <= 0 or (self.position == "rope" and self.rope_theta <= 0):
            raise bad(f"norm_eps and rope_theta must be positive, got {self.norm_eps} and {self.rope_theta}")

    # --- derived -----------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer in self.moe_layers

    def window_of(self, layer: int) -> int:
        """Sliding window of ``layer`` in tokens (0 = attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def uses_local_rope(self, layer: int) -> bool:
        """Windowed layer with its own unscaled rope base (Gemma 3)."""
        return self.rope_local_theta > 0 and self.window_of(layer) > 0

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def ffn_is_relu_sparse(self) -> bool:
        """Activations are exact zeros (ReLU-family), so sparsity needs no magnitude threshold."""
        return self.hidden_act in ("relu", "fatrelu", "drelu")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope_scaling"] = freeze_mapping(d.get("rope_scaling") or {})
        for key in ("eos_token_ids", "moe_layers", "layer_windows"):
            d[key] = tuple(d.get(key) or ())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def fingerprint_dict(self) -> dict[str, Any]:
        """What identifies the architecture (no token ids): used in artifact fingerprints."""
        d = self.to_dict()
        for key in ("bos_token_id", "eos_token_ids", "pad_token_id", "max_context"):
            d.pop(key, None)
        for f in dataclasses.fields(self):  # fields added later leave older fingerprints unchanged
            if f.name in _LATER_FIELDS and d.get(f.name) == f.default:
                d.pop(f.name, None)
        return d


_LATER_FIELDS = ("qk_norm", "sandwich_norms", "embed_scale", "attn_scale", "final_logit_softcap",
                 "layer_windows", "rope_local_theta")


def freeze_mapping(m: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A dict as sorted items (lists become tuples), so it can live in a frozen dataclass."""
    def freeze(v: Any) -> Any:
        if isinstance(v, dict):
            return freeze_mapping(v)
        if isinstance(v, list):
            return tuple(freeze(x) for x in v)
        return v
    return tuple(sorted((str(k), freeze(v)) for k, v in m.items()))


def kv_row_bytes(cfg: ModelConfig, bytes_per_element: float = 4.0) -> float:
    """Bytes of one position's keys and values in one layer, every KV head: what the KV cache stores per layer
    and token, and what attention reads per layer and attended token (``bytes_per_element`` 4: float32, 2: float16)."""
    return 2 * cfg.num_kv_heads * cfg.head_dim * bytes_per_element
