"""Speculative prefetch: guess the next MoE layer's experts while the current layer runs.

The guess applies the NEXT layer's router to the CURRENT layer's FFN input (the mixtral-offloading
trick: the residual stream changes little between adjacent layers); any callable with the same
signature (e.g. a trained expert predictor) can replace it. The guessed experts that are not on
the tier yet are copied into the next layer's cache on the copier (a CUDA stream or a background
thread), so the copy overlaps this layer's compute.

Measured: ``recall`` = share of the experts the next layer actually selects (per token) that the
guess contained; ``precision`` = share of prefetch copies that the next layer then used.

Example::

    prefetcher = Prefetcher(cfg, layer_weights)           # next-layer router guesses
    prefetcher.issue(layer, x, caches, packed)            # from inside layer `layer`'s forward
    prefetcher.evaluate(layer + 1, expert_ids)            # when layer+1 has routed
    prefetcher.recall, prefetcher.precision
"""
from __future__ import annotations

from typing import Callable

import torch

from tandem.core.config import ModelConfig
from tandem.core.ffn.dense import route
from tandem.core.ffn.weights import MoELayerWeights

Guesser = Callable[[int, torch.Tensor], torch.Tensor]  # (target layer, x [T, d]) -> expert ids [T, k]


def ranked_experts(expert_ids: torch.Tensor) -> list[int]:
    """Distinct experts of a [T, k] selection, most tokens first (ties: better rank, then lower id)."""
    T, k = expert_ids.shape
    score: dict[int, tuple[int, int]] = {}
    for rank in range(k):
        for e in expert_ids[:, rank].tolist():
            count, best = score.get(e, (0, k))
            score[e] = (count + 1, min(best, rank))
    return sorted(score, key=lambda e: (-score[e][0], score[e][1], e))


class Prefetcher:
    def __init__(self, cfg: ModelConfig, layer_weights: list, guesser: Guesser | None = None) -> None:
        self.cfg = cfg
        moe_layers = [i for i, w in enumerate(layer_weights) if isinstance(w, MoELayerWeights)]
        self.next_moe = {a: b for a, b in zip(moe_layers, moe_layers[1:])}
        self._routers = {i: layer_weights[i] for i in moe_layers}
        self.guesser = guesser or self._router_guess
        self._guesses: dict[int, torch.Tensor] = {}  # target layer -> guessed ids [T, k]
        self._copied: dict[int, set[int]] = {}  # target layer -> experts copied by prefetch
        self._last_layer = -1
        self.guessed_hits = 0
        self.guessed_total = 0
        self.copies = 0
        self.copies_used = 0

    def _router_guess(self, target: int, x: torch.Tensor) -> torch.Tensor:
        return route(self.cfg, self._routers[target], x)[0]  # [T, k]

    def issue(self, layer: int, x: torch.Tensor, caches: dict, packed: dict) -> None:
        """Guess layer ``layer``'s successor's experts from x [T, d] and start copying them."""
        if layer <= self._last_layer:  # a new forward pass: guesses from the last one are stale
            self._guesses.clear()
            self._copied.clear()
        self._last_layer = layer
        target = self.next_moe.get(layer)
        if target is None:
            return
        guess = self.guesser(target, x)  # [T, k]
        self._guesses[target] = guess
        cache = caches[target]
        candidates = ranked_experts(guess)[:cache.num_slots + len(cache.pinned)]
        copied = set()
        for e in candidates:
            if cache.contains(e) or not cache.can_insert(exclude=candidates):
                continue
            cache.insert(e, packed[target][e].host, exclude=candidates)
            copied.add(e)
        self._copied[target] = copied
        self.copies += len(copied)

    def evaluate(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Score the guess made for ``layer`` against its actual selection [T, k]."""
        guess = self._guesses.pop(layer, None)
        copied = self._copied.pop(layer, set())
        if guess is None or guess.shape[0] != expert_ids.shape[0]:
            return
        self.guessed_hits += int((expert_ids[:, :, None] == guess[:, None, :]).any(2).sum())
        self.guessed_total += expert_ids.numel()
        used = set(expert_ids.unique().tolist())
        self.copies_used += len(copied & used)

    @property
    def recall(self) -> float:
        return self.guessed_hits / self.guessed_total if self.guessed_total else 0.0

    @property
    def precision(self) -> float:
        return self.copies_used / self.copies if self.copies else 0.0
