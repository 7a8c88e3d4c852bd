"""Per-layer FFN and MoE weights, taken out of a checkpoint's tensors (no copies)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.errors import TandemError
from ..config import ModelConfig


@dataclass
class FFNWeights:
    """One FFN (dense layer, expert or shared expert). ``gate`` is None for plain (OPT) FFNs."""
    up: torch.Tensor  # [F, d]
    down: torch.Tensor  # [d, F]
    gate: torch.Tensor | None = None  # [F, d]
    up_bias: torch.Tensor | None = None  # [F]
    gate_bias: torch.Tensor | None = None  # [F]
    down_bias: torch.Tensor | None = None  # [d]

    @property
    def n_neurons(self) -> int:
        return self.up.shape[0]

    def decoded(self) -> "FFNWeights":
        """These weights with deferred ones decoded (loading/deferred.py): for work that reads them many times.

        Example::

            w = ffn_layers[3].decoded()   # holds the layer's float32 matrices until w goes
        """
        from ..loading.deferred import DeferredTensor
        fields = {k: (v.materialize() if isinstance(v, DeferredTensor) else v) for k, v in vars(self).items()}
        return FFNWeights(**fields)

    @property
    def nbytes(self) -> int:
        tensors = (self.up, self.down, self.gate, self.up_bias, self.gate_bias, self.down_bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class MoELayerWeights:
    router: torch.Tensor  # [E, d]
    experts: list[FFNWeights]
    shared_expert: FFNWeights | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, d]

    @property
    def nbytes(self) -> int:
        shared = self.shared_expert.nbytes if self.shared_expert is not None else 0
        return sum(e.nbytes for e in self.experts) + self.router.numel() * self.router.element_size() + shared


def _take(tensors: dict[str, torch.Tensor], name: str, required: bool = True) -> torch.Tensor | None:
    t = tensors.pop(name, None)
    if t is None and required:
        raise TandemError(f"checkpoint is missing tensor {name}")
    return t


def _ffn(tensors: dict[str, torch.Tensor], prefix: str, gated: bool) -> FFNWeights:
    return FFNWeights(
        up=_take(tensors, f"{prefix}.up_proj.weight"), down=_take(tensors, f"{prefix}.down_proj.weight"),
        gate=_take(tensors, f"{prefix}.gate_proj.weight") if gated else None,
        up_bias=_take(tensors, f"{prefix}.up_proj.bias", False),
        gate_bias=_take(tensors, f"{prefix}.gate_proj.bias", False) if gated else None,
        down_bias=_take(tensors, f"{prefix}.down_proj.bias", False))


def extract_ffn_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> list[FFNWeights | MoELayerWeights]:
    """Pop every FFN/MoE tensor out of ``tensors`` (canonical names) into per-layer weights."""
    layers: list[FFNWeights | MoELayerWeights] = []
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}.mlp"
        if not cfg.is_moe_layer(i):
            layers.append(_ffn(tensors, prefix, cfg.mlp_gated))
            continue
        experts = [_ffn(tensors, f"{prefix}.experts.{e}", True) for e in range(cfg.num_experts)]
        shared = shared_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = _ffn(tensors, f"{prefix}.shared_expert", True)
            shared_gate = _take(tensors, f"{prefix}.shared_expert_gate.weight")
        layers.append(MoELayerWeights(router=_take(tensors, f"{prefix}.router.weight"), experts=experts,
                                      shared_expert=shared, shared_expert_gate=shared_gate))
    return layers
