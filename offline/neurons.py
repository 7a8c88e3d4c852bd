"""Per-neuron activation statistics: frequency, mean |h|, hot ranking and skew.

A neuron is *active* for a token when ``|h| > threshold[layer]`` (h = input of the down
projection); with threshold 0 this is "non-zero", i.e. ReLU's exact zeros.

Example::

    stats = NeuronObserver(cfg, thresholds=torch.zeros(cfg.num_layers))
    executor = InstrumentedExecutor(engine.executor, stats)       # offline.collect
    ...run windows...
    freq = stats.frequency()                  # [L, F] fraction of tokens where each neuron is active
    order = hot_order(freq, stats.mean_abs())  # [L, F] hottest first
    skew_fraction(freq)                       # [L] share of neurons carrying 80% of the activations
"""
from __future__ import annotations

import torch

from tandem.core.config import ModelConfig
from .collect import LayerObservation


def neuron_width(cfg: ModelConfig) -> int:
    """Columns of the [L, F] neuron tensors: the dense FFN width (MoE-only models: the expert width)."""
    return cfg.intermediate_size or cfg.moe_intermediate_size


class NeuronObserver:
    """Accumulates active counts and |h| sums per neuron (dense layers, and routed experts of MoE layers)."""

    def __init__(self, cfg: ModelConfig, thresholds: torch.Tensor | None = None) -> None:
        n_layers, width = cfg.num_layers, neuron_width(cfg)
        self.cfg = cfg
        self.thresholds = torch.zeros(n_layers) if thresholds is None else thresholds.float().clone()  # [L]
        self.active = torch.zeros(n_layers, width, dtype=torch.int64)  # [L, F]
        self.abs_sum = torch.zeros(n_layers, width, dtype=torch.float64)  # [L, F]
        self.tokens = torch.zeros(n_layers, dtype=torch.int64)  # [L]
        n_experts, expert_width = cfg.num_experts, cfg.moe_intermediate_size
        self.expert_active = torch.zeros(n_layers, n_experts, expert_width, dtype=torch.int64)  # [L, E, Fe]
        self.expert_abs_sum = torch.zeros(n_layers, n_experts, expert_width, dtype=torch.float64)  # [L, E, Fe]
        self.expert_tokens = torch.zeros(n_layers, n_experts, dtype=torch.int64)  # [L, E]

    def observe(self, obs: LayerObservation) -> None:
        i, t = obs.layer, float(self.thresholds[obs.layer])
        if obs.h is not None:
            a = obs.h.abs()  # [T, F]
            self.active[i] += (a > t).sum(0)
            self.abs_sum[i] += a.sum(0, dtype=torch.float64)
            self.tokens[i] += a.shape[0]
        for expert, (token_idx, h) in obs.expert_h.items():
            a = h.abs()  # [n, Fe]
            self.expert_active[i, expert] += (a > t).sum(0)
            self.expert_abs_sum[i, expert] += a.sum(0, dtype=torch.float64)
            self.expert_tokens[i, expert] += a.shape[0]

    def frequency(self) -> torch.Tensor:
        """[L, F] float32: fraction of observed tokens with the neuron active (0 for unobserved layers)."""
        return (self.active.double() / self.tokens.clamp(min=1)[:, None]).float()

    def mean_abs(self) -> torch.Tensor:
        """[L, F] float32: mean |h| per neuron."""
        return (self.abs_sum / self.tokens.clamp(min=1)[:, None]).float()

    def expert_frequency(self) -> torch.Tensor:
        """[L, E, Fe] float32: per expert, fraction of the tokens routed to it with the neuron active."""
        return (self.expert_active.double() / self.expert_tokens.clamp(min=1)[..., None]).float()

    def layer_sparsity(self) -> torch.Tensor:
        """[L] float32: fraction of inactive (token, neuron) pairs, experts included, per layer."""
        active = self.active.sum(1).double() + self.expert_active.sum((1, 2)).double()
        total = self.tokens.double() * self.active.shape[1] + self.expert_tokens.double().sum(1) * self.expert_active.shape[2]
        return torch.where(total > 0, 1 - active / total.clamp(min=1), torch.zeros_like(total)).float()


def hot_order(freq: torch.Tensor, mean_abs: torch.Tensor) -> torch.Tensor:
    """[L, F] int64: neuron indices by descending frequency, ties by descending mean |h|, then index."""
    order = torch.empty(freq.shape, dtype=torch.int64)
    for i in range(freq.shape[0]):
        by_mag = torch.sort(-mean_abs[i].double(), stable=True).indices  # secondary key first
        by_freq = torch.sort(-freq[i, by_mag].double(), stable=True).indices
        order[i] = by_mag[by_freq]
    return order


def skew_fraction(freq: torch.Tensor, mass: float = 0.8) -> torch.Tensor:
    """[L] float32: smallest fraction of a layer's neurons whose activations make up ``mass`` of the total.

    A flat spread gives ``mass`` itself; a power law (ReLU OPT) gives far less. NaN for a layer
    without activations.
    """
    out = torch.full((freq.shape[0],), float("nan"))
    for i in range(freq.shape[0]):
        f = torch.sort(freq[i].double(), descending=True).values
        total = float(f.sum())
        if total <= 0:
            continue
        cum = torch.cumsum(f, 0) / total
        k = int(torch.searchsorted(cum, torch.tensor([mass - 1e-12], dtype=torch.float64)).item()) + 1
        out[i] = min(k, f.numel()) / f.numel()
    return out
