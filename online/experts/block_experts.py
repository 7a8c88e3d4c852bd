"""MoE experts read in a GGUF file's blocks (or packed from float), for a packed engine without an expert cache.

A Mixtral- or Qwen-MoE GGUF keeps its experts in Q4_0 / Q4_1 / Q8_0 / k-quant blocks. Decoded to float32
they take 7-8x the file's bytes (a 26 GB Mixtral Q4_0 would need ~180 GB), so a packed engine keeps each
expert as the file stores it: gate / up rows and the down projection ``[d, n_ff]`` (its blocks run along
n_ff: one dense product over the expert's h) in place, read by the same C row kernels as the dense layers
(``QuantizedFFN`` with a dense down on the module path; the fused step's ``moe.h`` reads the same bytes).
A shared expert (Qwen2-MoE) is packed alike; the router and the shared expert's gate vector stay float32. Experts
without such blocks (a float checkpoint, another block type) are quantized to the engine's int4 / int8 in the same
layout, as its dense layers are.

Example::

    layers = block_moe_layers(cfg, {3: moe_weights}, ckpt.raw, ExecutionSettings(weight_format="int4"))
    y = layers[3].forward(x)   # x: float32 [T, d] -> [T, d], moe_forward's routing and combine
"""
from __future__ import annotations

import numpy as np
import torch

from tandem.core.config import ModelConfig
from tandem.core.ffn.dense import gated_shared, moe_forward
from tandem.core.ffn.weights import MoELayerWeights
from ..execution.quantized_linear import DENSE_DOWN_EXTRA, EXACT_GGUF_TYPES, IN_PLACE_GGUF_TYPES
from ..kernels.ffn import QuantizedFFN
from ..kernels.quantize import quantize

DOWN_GGUF_TYPES = (*IN_PLACE_GGUF_TYPES, *DENSE_DOWN_EXTRA, "Q8_0")  # kinds the row kernels read as a dense down


class BlockExperts:
    """One MoE layer: the float router of ``weights``, its experts (and ``shared`` expert, with the float gate
    vector of ``weights``) as ``QuantizedFFN``s in the file's blocks (``threshold``: |h| <= it does not reach the
    down projection; < 0: every neuron)."""

    def __init__(self, cfg: ModelConfig, weights: MoELayerWeights, experts: list[QuantizedFFN], threshold: float,
                 shared: QuantizedFFN | None = None):
        self.cfg, self.experts, self.threshold, self.shared = cfg, experts, float(threshold), shared
        self.shared_gate = weights.shared_expert_gate  # [1, d] float32, or None
        self.weights = MoELayerWeights(router=weights.router, experts=[])  # no float experts kept

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on its tokens x [n, d] -> [n, d]."""
        return torch.from_numpy(self.experts[e].forward_numpy(np.ascontiguousarray(x.numpy()), self.threshold)[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on x [T, d] (float32) -> [T, d]: route, experts, combine, shared expert (moe_forward's order)."""
        out = moe_forward(self.cfg, self.weights, x, self.expert_forward)  # [T, d]
        if self.shared is None:
            return out
        y = torch.from_numpy(self.shared.forward_numpy(np.ascontiguousarray(x.numpy()), self.threshold)[0])  # [T, d]
        return out + gated_shared(x, self.shared_gate, y)

    @property
    def nbytes(self) -> int:
        shared = self.shared.nbytes + self.shared_gate.numel() * 4 if self.shared is not None else 0
        return sum(e.nbytes for e in self.experts) + self.weights.router.numel() * 4 + shared


def expert_blocks_of(raw: dict | None, layer: int, expert: int | None = None) -> dict | None:
    """The GGUF tensors {"up", "gate", "down"} of an expert (None: the shared expert), or None."""
    prefix = f"model.layers.{layer}.mlp." + ("shared_expert" if expert is None else f"experts.{expert}")
    found = {n: (raw or {}).get(f"{prefix}.{n}_proj.weight") for n in ("up", "gate", "down")}
    return found if all(t is not None for t in found.values()) else None


def _readable(blocks: dict, weight_format: str) -> bool:
    exact = EXACT_GGUF_TYPES.get(weight_format, ())
    return (blocks["up"].qtype in exact and blocks["gate"].qtype in exact and blocks["down"].qtype in DOWN_GGUF_TYPES
            and blocks["down"].shape[1] % 32 == 0)


def packable(w) -> bool:
    """Whether an expert (FFNWeights) packs here: gated, no biases, 32-wide blocks dividing d and n_ff."""
    return (w.gate is not None and w.up_bias is None and w.gate_bias is None and w.down_bias is None
            and w.up.shape[1] % 32 == 0 and w.up.shape[0] % 32 == 0)


def pack_ffn(cfg: ModelConfig, w, blocks: dict | None, fmt: str, threads: int) -> QuantizedFFN:
    """One expert (``packable``): the file's ``blocks`` where the kernels read them in ``fmt`` (int4 / int8), else
    quantized from float (gate / up rows and the dense down [d, n_ff], all in ``fmt``)."""
    kw = dict(act=cfg.hidden_act, act_threshold=cfg.act_threshold, threads=threads)
    if blocks is not None and _readable(blocks, fmt):
        return QuantizedFFN.from_gguf(blocks["up"], blocks["down"], blocks["gate"], dense_down=True, **kw)
    q = {n: quantize(getattr(w, n).detach().float().numpy(), fmt) for n in ("up", "gate", "down")}
    return QuantizedFFN(q["up"], None, q["gate"], down=q["down"], **kw)


def block_moe_layers(cfg: ModelConfig, moe_layers: dict[int, MoELayerWeights], raw: dict | None,
                     settings) -> dict[int, BlockExperts]:
    """The MoE layers of a packed ``settings.weight_format`` (int4 / int8) engine with gated experts without
    biases, each expert in the file's blocks where the kernels read them in that format (int4: Q4_0 / Q4_1 /
    k-quants; int8: Q8_0 / k-quants), else quantized to it. ``settings``: an ExecutionSettings."""
    out, weight_format = {}, settings.weight_format
    if weight_format not in EXACT_GGUF_TYPES:
        return out  # fp32: the float experts
    threshold = 0.0 if settings.sparse and cfg.ffn_is_relu_sparse else -1.0  # moe.h's: exact zeros skip the down
    for layer, w in moe_layers.items():
        ffns = w.experts + ([w.shared_expert] if w.shared_expert is not None else [])
        if not all(packable(e) for e in ffns):
            continue
        fmt, threads = weight_format, settings.threads
        experts = [pack_ffn(cfg, e, expert_blocks_of(raw, layer, j), fmt, threads) for j, e in enumerate(w.experts)]
        shared = None if w.shared_expert is None else pack_ffn(cfg, w.shared_expert, expert_blocks_of(raw, layer),
                                                               fmt, threads)
        out[layer] = BlockExperts(cfg, w, experts, threshold, shared)
    return out


def unread_expert_bytes(executor, cfg: ModelConfig) -> int:
    """Bytes of the experts a decoded token does not read: per MoE layer, all but top_k of its experts (those
    ``executor.ffn_nbytes`` counts: packed, in a cache's host buffers, or float)."""
    if not cfg.is_moe:
        return 0
    runtime, total, blocks = getattr(executor, "experts", None), 0, getattr(executor, "block_moe", {})
    floats = getattr(executor, "float_moe", None)
    if floats is None:  # the dense executor: its float layers
        floats = {i: w for i, w in enumerate(getattr(executor, "layers", [])) if isinstance(w, MoELayerWeights)}
    for i in range(cfg.num_layers):
        if runtime is not None and i in runtime.packed:
            sizes = [p.nbytes for p in runtime.packed[i]]
        elif i in blocks:
            sizes = [q.nbytes for q in blocks[i].experts]
        elif i in floats:
            sizes = [e.nbytes for e in floats[i].experts]
        else:
            continue
        total += sum(sizes) * (len(sizes) - cfg.num_experts_per_tok) // max(len(sizes), 1)
    return total
