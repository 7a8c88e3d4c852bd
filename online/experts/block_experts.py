"""MoE experts read in a GGUF file's blocks, for a packed engine without an expert cache.

A Mixtral- or Qwen-MoE GGUF keeps its experts in Q4_0 / Q4_1 / Q8_0 / k-quant blocks. Decoded to float32
they take 7-8x the file's bytes (a 26 GB Mixtral Q4_0 would need ~180 GB), so a packed engine keeps each
expert as the file stores it: gate / up rows and the down projection ``[d, n_ff]`` (its blocks run along
n_ff: one dense product over the expert's h) in place, read by the same C row kernels as the dense layers
(``QuantizedFFN`` with a dense down on the module path; the fused step's ``moe.h`` reads the same bytes).
The router and a shared expert stay float32 (a few MB).

Example::

    layers = block_moe_layers(cfg, {3: moe_weights}, ckpt.raw, ExecutionSettings(weight_format="int4"))
    y = layers[3].forward(x)   # x: float32 [T, d] -> [T, d], moe_forward's routing and combine
"""
from __future__ import annotations

import numpy as np
import torch

from tandem.core.config import ModelConfig
from tandem.core.ffn.dense import moe_forward
from tandem.core.ffn.weights import MoELayerWeights
from ..execution.quantized_linear import DENSE_DOWN_EXTRA, EXACT_GGUF_TYPES, IN_PLACE_GGUF_TYPES
from ..kernels.ffn import QuantizedFFN

DOWN_GGUF_TYPES = (*IN_PLACE_GGUF_TYPES, *DENSE_DOWN_EXTRA, "Q8_0")  # kinds the row kernels read as a dense down


class BlockExperts:
    """One MoE layer: the float router and shared expert of ``weights``, its experts as ``QuantizedFFN``s in
    the file's blocks (``threshold``: |h| <= it does not reach the down projection; < 0: every neuron)."""

    def __init__(self, cfg: ModelConfig, weights: MoELayerWeights, experts: list[QuantizedFFN], threshold: float):
        self.cfg, self.experts, self.threshold = cfg, experts, float(threshold)
        self.weights = MoELayerWeights(router=weights.router, experts=[], shared_expert=weights.shared_expert,
                                       shared_expert_gate=weights.shared_expert_gate)  # no float experts kept

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on its tokens x [n, d] -> [n, d]."""
        return torch.from_numpy(self.experts[e].forward_numpy(np.ascontiguousarray(x.numpy()), self.threshold)[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on x [T, d] (float32) -> [T, d]: route, experts, combine, shared expert."""
        return moe_forward(self.cfg, self.weights, x, self.expert_forward)

    @property
    def nbytes(self) -> int:
        shared = self.weights.shared_expert.nbytes if self.weights.shared_expert is not None else 0
        return sum(e.nbytes for e in self.experts) + self.weights.router.numel() * 4 + shared


def _expert_blocks(raw: dict, layer: int, expert: int) -> dict | None:
    prefix = f"model.layers.{layer}.mlp.experts.{expert}"
    found = {n: raw.get(f"{prefix}.{n}_proj.weight") for n in ("up", "gate", "down")}
    return found if all(t is not None for t in found.values()) else None


def _readable(blocks: dict, weight_format: str) -> bool:
    exact = EXACT_GGUF_TYPES.get(weight_format, ())
    rows, cols = blocks["down"].shape
    return (blocks["up"].qtype in exact and blocks["gate"].qtype in exact and blocks["down"].qtype in DOWN_GGUF_TYPES
            and cols % 32 == 0)


def block_moe_layers(cfg: ModelConfig, moe_layers: dict[int, MoELayerWeights], raw: dict | None,
                     settings) -> dict[int, BlockExperts]:
    """The layers of ``moe_layers`` whose every expert has gated GGUF blocks the kernels read in the packed
    ``settings.weight_format`` (int4: Q4_0 / Q4_1 / k-quants; int8: Q8_0 / k-quants), without biases; others
    stay float. ``settings``: an ExecutionSettings (weight_format, sparse, threads)."""
    out, weight_format = {}, settings.weight_format
    if weight_format not in EXACT_GGUF_TYPES or not raw:
        return out
    threshold = 0.0 if settings.sparse and cfg.ffn_is_relu_sparse else -1.0  # moe.h's: exact zeros skip the down
    for layer, w in moe_layers.items():
        blocks = [_expert_blocks(raw, layer, e) for e in range(len(w.experts))]
        if not all(b is not None and _readable(b, weight_format) for b in blocks):
            continue
        if any(e.gate is None or e.up_bias is not None or e.gate_bias is not None or e.down_bias is not None
               for e in w.experts):
            continue
        experts = [QuantizedFFN.from_gguf(b["up"], b["down"], b["gate"], dense_down=True, act=cfg.hidden_act,
                                          act_threshold=cfg.act_threshold, threads=settings.threads) for b in blocks]
        out[layer] = BlockExperts(cfg, w, experts, threshold)
    return out
