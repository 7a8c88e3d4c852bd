"""Calibrated magnitude thresholds on h (the input of the down projection) for non-ReLU models.

SwiGLU models have no exact zeros; sparsity means zeroing ``|h| <= t[layer]``. The thresholds
come from one uniform quantile q of each layer's |h| distribution on the training split; the
largest q whose perplexity increase on the training windows stays within the quality budget is
found by bisection (``search_uniform_sparsity``); the profiler then measures it on held-out text.

Example::

    hist = AbsHistogram(cfg.num_layers)                    # an observer (offline.collect)
    ...run the training windows with InstrumentedExecutor(engine.executor, hist)...
    t = hist.quantile_thresholds(0.45)                     # [L] thresholds for 45% sparsity
    executor = ThresholdedExecutor(engine.executor, t)     # zeroes |h| <= t before the down projection
    ppl, n = windows_perplexity(engine, executor, held_out_windows)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from tandem.core.ffn import DenseExecutor
from .collect import SHARED_EXPERT, InstrumentedExecutor, LayerObservation, run_windows

LOG2_MIN, LOG2_MAX = -40.0, 24.0  # |h| range covered by the histogram (2^-40 .. 2^24)
BINS_PER_OCTAVE = 128
MAX_SEARCH_SPARSITY = 0.95


class AbsHistogram:
    """Observer: per-layer histogram of log2|h| (dense h and routed experts' h; shared experts excluded)."""

    def __init__(self, num_layers: int) -> None:
        self.n_bins = int((LOG2_MAX - LOG2_MIN) * BINS_PER_OCTAVE)
        self.counts = torch.zeros(num_layers, self.n_bins, dtype=torch.float64)  # [L, B]

    def add(self, layer: int, h: torch.Tensor) -> None:
        logs = torch.log2(h.abs().float()).nan_to_num_(nan=LOG2_MAX)  # [n, F]; 0 -> -inf -> lowest bin
        bins = ((logs - LOG2_MIN) * BINS_PER_OCTAVE).clamp_(0, self.n_bins - 1).long()  # [n, F]
        self.counts[layer] += torch.bincount(bins.flatten(), minlength=self.n_bins).double()

    def observe(self, obs: LayerObservation) -> None:
        if obs.h is not None:
            self.add(obs.layer, obs.h)
        for _, h in obs.expert_h.values():
            self.add(obs.layer, h)

    def quantile_thresholds(self, quantile: float) -> torch.Tensor:
        """[L] float32: per layer, the |h| below which ``quantile`` of the values lie (0 where unobserved)."""
        if not 0.0 <= quantile < 1.0:
            raise ValueError(f"quantile must be in [0, 1), got {quantile}")
        out = torch.zeros(self.counts.shape[0])
        width = 1.0 / BINS_PER_OCTAVE
        for i, counts in enumerate(self.counts):
            total = float(counts.sum())
            if total == 0 or quantile == 0.0:
                continue
            cum = torch.cumsum(counts, 0)  # [B]
            target = quantile * total
            b = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64)).item())
            b = min(b, self.n_bins - 1)
            before = float(cum[b - 1]) if b > 0 else 0.0
            frac = (target - before) / max(float(counts[b]), 1e-300)
            out[i] = 2.0 ** (LOG2_MIN + (b + min(max(frac, 0.0), 1.0)) * width)
        return out


class ThresholdedExecutor(InstrumentedExecutor):
    """Zeroes ``|h| <= thresholds[layer]`` before the down projection (threshold 0: exact dense).

    Counts what it zeroed: ``sparsity()`` -> [L] achieved fraction per layer. Shared experts stay dense.
    """

    def __init__(self, base: DenseExecutor, thresholds: torch.Tensor, observer=None) -> None:
        super().__init__(base, observer)
        if thresholds.shape != (self.cfg.num_layers,):
            raise ValueError(f"thresholds must have shape [{self.cfg.num_layers}], got {list(thresholds.shape)}")
        self.thresholds = [float(t) for t in thresholds]
        self.zeroed = torch.zeros(self.cfg.num_layers, dtype=torch.float64)  # [L]
        self.seen = torch.zeros(self.cfg.num_layers, dtype=torch.float64)  # [L]

    def transform_hidden(self, layer: int, x: torch.Tensor, h: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        if expert == SHARED_EXPERT:
            return h
        self.seen[layer] += h.numel()
        t = self.thresholds[layer]
        if t <= 0.0:
            return h
        keep = h.abs() > t  # [T, F]
        self.zeroed[layer] += h.numel() - int(keep.sum())
        return torch.where(keep, h, torch.zeros((), dtype=h.dtype))

    def sparsity(self) -> torch.Tensor:
        """[L] float32: fraction of h entries zeroed so far."""
        return (self.zeroed / self.seen.clamp(min=1)).float()


def windows_perplexity(engine, executor: DenseExecutor, windows: Sequence[list[int]],
                       on_window: Callable | None = None) -> tuple[float, int]:
    """Perplexity over windows (each a fresh context; every token after a window's first is scored)."""
    nll, scored = 0.0, 0
    for ids, logits in zip(windows, run_windows(engine, executor, windows, all_logits=True, on_window=on_window)):
        if len(ids) < 2:
            continue
        nll += float(F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="none").double().sum())
        scored += len(ids) - 1
    if scored == 0:
        raise ValueError("no tokens to score")
    return math.exp(nll / scored), scored


@dataclass
class SearchPoint:
    sparsity: float  # uniform quantile tried
    perplexity: float
    increase: float  # relative to dense


@dataclass
class ThresholdSearch:
    """Outcome of the bisection: the adopted uniform quantile and what it measured on the windows it
    was given (the profiler searches on training windows and re-measures held-out text)."""
    quantile: float
    thresholds: torch.Tensor  # [L]
    dense_perplexity: float
    sparse_perplexity: float
    held_out_sparsity: torch.Tensor  # [L] achieved on held-out text
    scored_tokens: int
    points: list[SearchPoint] = field(default_factory=list)
    selection_increase: float | None = None  # the increase on the selection windows, when re-measured

    @property
    def increase(self) -> float:
        return self.sparse_perplexity / self.dense_perplexity - 1.0


def search_uniform_sparsity(engine, hist: AbsHistogram, held_out_windows: Sequence[list[int]],
                            max_quality_loss: float, steps: int = 7, dense_perplexity: float | None = None,
                            on_window: Callable | None = None, on_point: Callable | None = None,
                            lowest_quantile: float = 0.0) -> ThresholdSearch:
    """Bisection on the uniform quantile q in [lowest_quantile, MAX_SEARCH_SPARSITY]: the largest q whose
    perplexity increase on ``held_out_windows`` (the selection windows) is <= max_quality_loss (assumes
    the increase grows with q). Nothing within the budget: quantile 0 (dense)."""
    base = engine.executor
    if dense_perplexity is None:
        dense_perplexity, _ = windows_perplexity(engine, base, held_out_windows, on_window)
    zeros = torch.zeros(engine.config.num_layers)
    best = ThresholdSearch(0.0, zeros, dense_perplexity, dense_perplexity, zeros.clone(),
                           sum(max(len(w) - 1, 0) for w in held_out_windows))
    lo, hi = lowest_quantile, MAX_SEARCH_SPARSITY
    points: list[SearchPoint] = []
    for _ in range(steps):
        q = (lo + hi) / 2
        thresholds = hist.quantile_thresholds(q)
        executor = ThresholdedExecutor(base, thresholds)
        ppl, scored = windows_perplexity(engine, executor, held_out_windows, on_window)
        point = SearchPoint(q, ppl, ppl / dense_perplexity - 1.0)
        points.append(point)
        if on_point is not None:
            on_point(point)
        if point.increase <= max_quality_loss:
            lo = q
            best = ThresholdSearch(q, thresholds, dense_perplexity, ppl, executor.sparsity(), scored)
        else:
            hi = q
    best.points = points
    return best
