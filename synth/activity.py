"""Per-neuron firing rates with a chosen mean (1 - sparsity) and a power-law hot/cold skew.

``firing_rates(n, sparsity=0.9, hot_fraction=0.26, hot_share=0.8)`` returns rates p_i = min(cap,
c * rank^-alpha) in a random neuron order, with alpha and c solved so that the mean rate is
``1 - sparsity`` and the ``hot_fraction`` most active neurons carry ``hot_share`` of all activations
(PowerInfer's OPT figure: 26% of neurons, 80%).

Example::

    p = firing_rates(8192, sparsity=0.9, rng=np.random.default_rng(0))   # [8192], mean 0.1
    hot_share_of(p, 0.26)                                                # ~0.80
"""
from __future__ import annotations

import numpy as np

from tandem.core.errors import TandemError

RATE_CAP = 0.98  # no neuron fires on every token


def hot_share_of(rates: np.ndarray, hot_fraction: float) -> float:
    """Share of all activations carried by the ``hot_fraction`` most active neurons."""
    r = np.sort(np.asarray(rates, dtype=np.float64))[::-1]
    k = max(1, int(round(hot_fraction * r.size)))
    total = r.sum()
    return float(r[:k].sum() / total) if total > 0 else 0.0


def _rates(n: int, mean: float, alpha: float) -> np.ndarray:
    base = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    lo, hi = 0.0, mean / base.mean() * 1e6
    for _ in range(100):  # c so that mean(min(cap, c * base)) = mean
        c = 0.5 * (lo + hi)
        if np.minimum(RATE_CAP, c * base).mean() < mean:
            lo = c
        else:
            hi = c
    return np.minimum(RATE_CAP, hi * base)


def max_hot_share(sparsity: float, hot_fraction: float) -> float:
    """The largest hot share reachable when every hot neuron fires at the cap."""
    return min(1.0, hot_fraction * RATE_CAP / (1.0 - sparsity))


def firing_rates(n: int, sparsity: float = 0.9, hot_fraction: float = 0.26, hot_share: float = 0.8,
                 rng: np.random.Generator | None = None) -> np.ndarray:
    if not 0.0 < sparsity < 1.0:
        raise TandemError(f"sparsity must be in (0, 1), got {sparsity}")
    if not 0.0 < hot_fraction < 1.0 or not hot_fraction <= hot_share < 1.0:
        raise TandemError(f"need 0 < hot fraction ({hot_fraction}) <= hot share ({hot_share}) < 1")
    limit = max_hot_share(sparsity, hot_fraction)
    if hot_share > limit - 0.005:
        raise TandemError(f"at {sparsity:.0%} sparsity at most {limit:.0%} of activations can fall on "
                          f"{hot_fraction:.0%} of neurons; ask for a smaller --hot-share")
    mean = 1.0 - sparsity
    lo, hi = 0.0, 8.0
    for _ in range(60):  # share rises with alpha
        alpha = 0.5 * (lo + hi)
        if hot_share_of(_rates(n, mean, alpha), hot_fraction) < hot_share:
            lo = alpha
        else:
            hi = alpha
    rates = _rates(n, mean, hi)
    rng = rng or np.random.default_rng(0)
    return rates[rng.permutation(n)]
