"""MoE: guessing the next layer's experts from the current hidden state (for prefetch).

The free guess applies layer l+1's router to layer l's FFN input (the mixtral-offloading trick).
Where its top-k recall falls below ``min_free_recall`` (0.90), a small ``d -> rank -> E`` predictor
is trained on (x_l, experts chosen at l+1) with BCE, the smallest rank of a short ladder that beats
the free guess is kept, and it is used only if it does beat it on held-out tokens.

Example::

    guess = guess_next_experts(pset, layer=3, x=x3, next_router=moe4.router, k=2)  # [T, k] expert ids
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.core.config import ModelConfig
from tandem.core.ffn.dense import route
from tandem.core.ffn.weights import MoELayerWeights
from .model import LayerEntry, PredictorSet
from .train import TrainSettings, train_predictor

EXPERT_RANKS = (16, 32, 64, 128)
MIN_FREE_RECALL = 0.90


def topk_recall(guess: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean share of the true top-k experts [N, k] found in the guessed ones [N, k']."""
    hits = (guess[:, :, None] == truth[:, None, :]).any(dim=1)  # [N, k]
    return float(hits.float().mean())


def _multi_hot(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    return F.one_hot(expert_ids, n_experts).sum(dim=1) > 0  # [N, E]


def fit_expert_predictors(cfg: ModelConfig, layers: list, x_train: dict[int, torch.Tensor],
                          x_val: dict[int, torch.Tensor], settings: TrainSettings,
                          min_free_recall: float = MIN_FREE_RECALL, progress=None) -> dict[int, LayerEntry]:
    """One entry per MoE layer l whose next layer is MoE: the free-guess recall in its stats, and a
    trained predictor where the free guess falls short (``use`` only if it beats the free guess)."""
    k, n_experts = cfg.num_experts_per_tok, cfg.num_experts
    entries: dict[int, LayerEntry] = {}
    for layer in range(cfg.num_layers - 1):
        nxt = layers[layer + 1]
        if not isinstance(layers[layer], MoELayerWeights) or not isinstance(nxt, MoELayerWeights):
            continue
        truth_tr = route(cfg, nxt, x_train[layer + 1])[0]  # [N, k]
        truth_va = route(cfg, nxt, x_val[layer + 1])[0]
        free = F.linear(x_val[layer], nxt.router).topk(k, dim=-1).indices  # [N, k]
        free_recall = topk_recall(free, truth_va)
        stats = {"free_guess_recall": free_recall, "recall": free_recall, "precision": free_recall,
                 "predicted_sparsity": 1 - k / n_experts, "n_ff": n_experts, "guess": "next router"}
        entry = LayerEntry(mode="exact", stats=stats)
        if free_recall < min_free_recall:
            y_tr, y_va = _multi_hot(truth_tr, n_experts), _multi_hot(truth_va, n_experts)
            for rank in [r for r in EXPERT_RANKS if r <= cfg.hidden_size]:
                pred, _ = train_predictor(x_train[layer], y_tr, x_val[layer], y_va, rank, settings, progress=progress)
                with torch.no_grad():
                    recall = topk_recall(pred(x_val[layer]).topk(k, dim=-1).indices, truth_va)
                if recall > entry.stats["recall"]:
                    entry = LayerEntry(mode="predictor", predictor=pred,
                                       stats={**stats, "recall": recall, "precision": recall, "guess": "trained"})
                if recall >= min_free_recall:
                    break
        entries[layer] = entry
    return entries


def guess_next_experts(pset: PredictorSet | None, layer: int, x: torch.Tensor, next_router: torch.Tensor,
                       k: int) -> torch.Tensor:
    """Expert ids [T, k] expected at layer+1 given layer's FFN input x [T, d]: the trained predictor
    when the artifact has a used one for this layer, else the next router applied to x."""
    entry = pset.experts.get(layer) if pset is not None else None
    with torch.no_grad():
        if entry is not None and entry.mode == "predictor":
            scores = entry.predictor(x)  # [T, E]
        else:
            scores = F.linear(x, next_router)  # [T, E]
    return scores.topk(k, dim=-1).indices
