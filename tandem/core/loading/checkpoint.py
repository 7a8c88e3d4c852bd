"""Checkpoint: what every loader returns, in one canonical tensor naming.

Canonical names (all loaders map to these; weights are ``[out_features, in_features]``):

    model.embed_tokens.weight                      [vocab, d]
    model.embed_positions.weight                   [max_pos + offset, d]   (OPT only)
    model.layers.{i}.input_layernorm.weight (.bias for LayerNorm)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (.bias when present)
    model.layers.{i}.post_attention_layernorm.weight (.bias)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight (.bias)                (dense FFN; OPT: up=fc1, down=fc2)
    model.layers.{i}.mlp.router.weight             [E, d]                  (MoE router)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight           (Qwen2-MoE)
    model.layers.{i}.mlp.shared_expert_gate.weight [1, d]                   (Qwen2-MoE)
    model.norm.weight (.bias)
    lm_head.weight                                 (absent when embeddings are tied)

Q and K projections are in the Hugging Face (rotate-half) RoPE layout; the GGUF loader undoes
llama.cpp's row permutation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.core.artifacts import fingerprint
from ..config import ModelConfig


@dataclass(frozen=True)
class RawQuantTensor:
    """A tensor's on-disk quantized blocks (GGUF), kept for quantized kernels."""
    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0" | "F16" | "BF16" | "F32"
    shape: tuple[int, ...]  # logical shape, torch order [out, in]
    data: np.ndarray  # uint8 view over the file (memory-mapped), row-major blocks


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # canonical names -> float32 tensors
    source_path: Path  # the resolved .gguf file or HF folder
    model_id: str  # short name for artifact folders, e.g. "SmolLM2-135M-Instruct.Q4_1"
    tokenizer: Any = None  # tandem.core.loading.tokenizer.Tokenizer | None
    quant_types: dict[str, str] = field(default_factory=dict)  # canonical name -> on-disk type
    raw: dict[str, RawQuantTensor] = field(default_factory=dict)  # canonical name -> raw blocks
    # what artifacts are built for: computed once here, so emptying tensors later (build_model) cannot change it
    fingerprint: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.fingerprint = model_fingerprint(self.config, {k: tuple(v.shape) for k, v in self.tensors.items()})

    @property
    def deferred_bytes(self) -> int:
        """Float32 bytes of the tensors still in their blocks (decoded on use; loading/deferred.py)."""
        from .deferred import DeferredTensor
        return sum(4 * t.numel() for t in self.tensors.values() if isinstance(t, DeferredTensor))


def model_fingerprint(config: ModelConfig, tensor_shapes: dict[str, tuple[int, ...]]) -> str:
    """Hash of the architecture config and tensor names/shapes (what artifacts are built for)."""
    return fingerprint({"config": config.fingerprint_dict(),
                        "tensors": sorted((k, list(s)) for k, s in tensor_shapes.items())})
