"""MoE routing statistics: expert frequency, co-selection, top-k repeats, speculative recall.

Speculative recall (the mixtral-offloading trick): the router of layer l+a applied to the FFN input
of layer l (the hidden state layer l's own router sees) guesses layer l+a's top-k experts before
that layer runs; recall = share of the experts actually chosen at l+a that the guess contains.

Example::

    stats = ExpertObserver(cfg, executor.layers)      # an observer for offline.collect
    ...run windows with InstrumentedExecutor(engine.executor, stats)...
    stats.frequency()          # [L, E] share of tokens routed to each expert
    stats.repeat_rate()        # [L] share of consecutive token pairs with the same top-k set
    stats.speculative_recall() # [L, 2] recall 1 and 2 layers ahead (NaN where no MoE layer ahead)
"""
from __future__ import annotations

import torch

from tandem.core.config import ModelConfig
from tandem.core.ffn import MoELayerWeights
from tandem.core.ffn.dense import route
from .collect import LayerObservation

LOOKAHEAD_LAYERS = (1, 2)


class ExpertObserver:
    """Accumulates routing counts per MoE layer over the observed windows."""

    def __init__(self, cfg: ModelConfig, layer_weights: list) -> None:
        n_layers, n_experts = cfg.num_layers, cfg.num_experts
        self.cfg = cfg
        self.layer_weights = layer_weights
        self.tokens = torch.zeros(n_layers, dtype=torch.int64)  # [L]
        self.selected = torch.zeros(n_layers, n_experts, dtype=torch.int64)  # [L, E]
        self.coselect = torch.zeros(n_layers, n_experts, n_experts, dtype=torch.int64)  # [L, E, E]
        self.pairs = torch.zeros(n_layers, dtype=torch.int64)  # [L] consecutive token pairs
        self.repeats = torch.zeros(n_layers, dtype=torch.int64)  # [L] pairs with an identical top-k set
        self.kept = torch.zeros(n_layers, dtype=torch.int64)  # [L] experts also chosen by the previous token
        self.spec_hits = torch.zeros(n_layers, len(LOOKAHEAD_LAYERS), dtype=torch.int64)  # [L, 2]
        self.spec_total = torch.zeros(n_layers, len(LOOKAHEAD_LAYERS), dtype=torch.int64)  # [L, 2]
        self._pending: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # target layer -> (source, slot, guess)
        self._last_layer = -1

    def observe(self, obs: LayerObservation) -> None:
        if obs.routing is None:
            return
        i = obs.layer
        if i <= self._last_layer:  # a new forward pass: guesses from the previous one are stale
            self._pending.clear()
        self._last_layer = i
        ids = obs.routing.expert_ids  # [T, k]
        n_tokens, k = ids.shape
        onehot = torch.zeros(n_tokens, self.cfg.num_experts, dtype=torch.int64)  # [T, E]
        onehot.scatter_(1, ids, 1)
        self.tokens[i] += n_tokens
        self.selected[i] += onehot.sum(0)
        self.coselect[i] += onehot.T @ onehot
        if n_tokens > 1:
            self.pairs[i] += n_tokens - 1
            self.repeats[i] += int((onehot[1:] == onehot[:-1]).all(1).sum())
            self.kept[i] += int((onehot[1:] & onehot[:-1]).sum())
        for source, slot, guess in self._pending.pop(i, []):
            if guess.shape[0] == n_tokens:
                self.spec_hits[source, slot] += int((guess[:, :, None] == ids[:, None, :]).any(2).sum())
                self.spec_total[source, slot] += n_tokens * k
        for slot, ahead in enumerate(LOOKAHEAD_LAYERS):
            target = i + ahead
            if target < self.cfg.num_layers and isinstance(self.layer_weights[target], MoELayerWeights):
                guess, _, _ = route(self.cfg, self.layer_weights[target], obs.x)  # [T, k]
                self._pending.setdefault(target, []).append((i, slot, guess))

    def frequency(self) -> torch.Tensor:
        """[L, E] float32: fraction of tokens routed to each expert (rows sum to k; 0 for dense layers)."""
        return (self.selected.double() / self.tokens.clamp(min=1)[:, None]).float()

    def coselection(self) -> torch.Tensor:
        """[L, E, E] float32 counts: tokens that chose both experts (diagonal: tokens that chose the expert)."""
        return self.coselect.float()

    def repeat_rate(self) -> torch.Tensor:
        """[L] float32: share of consecutive token pairs whose top-k set is identical."""
        return (self.repeats.double() / self.pairs.clamp(min=1)).float()

    def kept_rate(self) -> torch.Tensor:
        """[L] float32: share of a token's experts that the previous token also used (cache reuse)."""
        k = max(self.cfg.num_experts_per_tok, 1)
        return (self.kept.double() / (self.pairs.clamp(min=1) * k)).float()

    def speculative_recall(self) -> torch.Tensor:
        """[L, 2] float32: recall of layer l+1's / l+2's experts guessed from layer l; NaN where none."""
        out = self.spec_hits.double() / self.spec_total.clamp(min=1)
        return torch.where(self.spec_total > 0, out, torch.full_like(out, float("nan"))).float()
