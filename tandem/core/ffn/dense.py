"""DenseExecutor: exact FFN and MoE computation, the reference every other executor matches.

Example::

    executor = DenseExecutor(cfg, extract_ffn_weights(cfg, tensors))
    y = executor.forward(layer=3, x=x)  # x [T, d] (normalized FFN input) -> [T, d]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .activations import activate, gated_hidden
from .weights import FFNWeights, MoELayerWeights


def ffn_hidden(cfg: ModelConfig, w: FFNWeights, x: torch.Tensor) -> torch.Tensor:
    """h [T, F]: the input of the down projection."""
    up = F.linear(x, w.up, w.up_bias)  # [T, F]
    if w.gate is None:
        return activate(cfg.hidden_act, up, cfg.act_threshold)
    gate = F.linear(x, w.gate, w.gate_bias)  # [T, F]
    return gated_hidden(cfg.hidden_act, gate, up, cfg.act_threshold)


def ffn_down(w: FFNWeights, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, w.down, w.down_bias)  # [T, d]


def route(cfg: ModelConfig, moe: MoELayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing: (expert ids [T, k], weights [T, k], router logits [T, E])."""
    logits = F.linear(x, moe.router)  # [T, E]
    probs = torch.softmax(logits.float(), dim=-1)
    weights, expert_ids = probs.topk(cfg.num_experts_per_tok, dim=-1)  # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return expert_ids, weights.to(x.dtype), logits


def gated_shared(x: torch.Tensor, shared_gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A shared expert's output ``y`` [T, d] scaled by sigmoid(shared_gate . x) (Qwen2-MoE), however ``y`` was
    computed (float here, packed rows in online/experts)."""
    return torch.sigmoid(F.linear(x, shared_gate)) * y


def shared_expert_out(cfg: ModelConfig, moe: MoELayerWeights, x: torch.Tensor) -> torch.Tensor:
    y = ffn_down(moe.shared_expert, ffn_hidden(cfg, moe.shared_expert, x))  # [T, d]
    return gated_shared(x, moe.shared_expert_gate, y)


def tokens_by_expert(expert_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The MoE dispatch: every selected expert (ascending) -> (token indices [n], top-k rank [n])."""
    return {expert: torch.where(expert_ids == expert) for expert in expert_ids.unique().tolist()}


def combine_experts(x: torch.Tensor, routed: dict[int, tuple[torch.Tensor, torch.Tensor]],
                    results: dict[int, torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """The MoE combine: each expert's output rows [n, d], scaled by their routing weights, summed into [T, d]
    (experts in ``routed``'s order, so every executor rounds alike)."""
    out = torch.zeros_like(x)  # [T, d]
    for expert, (token_idx, rank) in routed.items():
        out.index_add_(0, token_idx, results[expert].to(x.device) * weights[token_idx, rank, None])
    return out


def moe_forward(cfg: ModelConfig, moe: MoELayerWeights, x: torch.Tensor, expert_forward=None) -> torch.Tensor:
    """A float MoE block: route, each selected expert on its tokens, combine, shared expert. ``expert_forward(e,
    x_e)`` [n, d] -> [n, d] (default: expert e's float FFN)."""
    if expert_forward is None:
        def expert_forward(e: int, xs: torch.Tensor) -> torch.Tensor:
            return ffn_down(moe.experts[e], ffn_hidden(cfg, moe.experts[e], xs))
    expert_ids, weights, _ = route(cfg, moe, x)  # [T, k]
    routed = tokens_by_expert(expert_ids)
    results = {e: expert_forward(e, x[token_idx]) for e, (token_idx, _) in routed.items()}  # [n, d]
    out = combine_experts(x, routed, results, weights)  # [T, d]
    if moe.shared_expert is not None:
        out = out + shared_expert_out(cfg, moe, x)
    return out


class DenseExecutor:
    """Computes every neuron and every selected expert exactly (float32)."""

    def __init__(self, cfg: ModelConfig, layers: list[FFNWeights | MoELayerWeights]) -> None:
        self.cfg = cfg
        self.layers = layers

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        weights = self.layers[layer]
        if isinstance(weights, MoELayerWeights):
            return self.moe_forward(layer, x)
        return ffn_down(weights, ffn_hidden(self.cfg, weights, x))

    def expert_forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        w = self.layers[layer].experts[expert]
        return ffn_down(w, ffn_hidden(self.cfg, w, x))

    def moe_forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return moe_forward(self.cfg, self.layers[layer], x,
                           lambda e, xs: self.expert_forward(layer, e, xs))

    def output_logits(self, x: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, lm_head_weight)  # [T, vocab]

    @property
    def ffn_nbytes(self) -> int:
        return sum(w.nbytes for w in self.layers)

    packed = False  # float32 torch math (the contract: tandem.core.ffn.contract.Executor)
    head_nbytes = None  # reads the model's float head

    def counters_snapshot(self) -> None:
        return None

    def run_stats(self, delta: dict, steps: int, forward_steps: int, elapsed_s: float) -> dict:
        return {}
