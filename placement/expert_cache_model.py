"""Modeled hit rate of a per-layer LRU expert cache, from expert selection frequencies.

Che's approximation for LRU in token time: with ``rate_e`` the share of tokens routed to expert e,
a cache of c slots has a characteristic time T (in tokens) solving
``sum_e (1 - exp(-rate_e * T)) = c`` and expert e is a hit with probability ``1 - exp(-rate_e * T)``.
A token's experts are distinct and arrive together: before the j-th of a token's k requests, the
token's earlier misses (j * (1 - hit rate) on average) have pushed out older experts, so that
request sees ``slots - j * (1 - hit rate)`` slots of older experts (solved as a fixed point).
Routing also repeats itself (a token's top-k set often equals the previous token's); that share
of tokens hits whenever the cache can hold a token's experts.

Example::

    lru_hit_rate(np.array([0.5, 0.5, 0.3, 0.3, 0.2, 0.1, 0.05, 0.05]), cache_slots=4, repeat_rate=0.0)
"""
from __future__ import annotations

import numpy as np


def _che_curve(rates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(occupancy, hit rate) along a log grid of characteristic times, for interpolation by capacity."""
    times = np.geomspace(1e-4 / rates.max(), 1e4 / rates.min(), 600)  # [T]
    filled = -np.expm1(-np.outer(times, rates))  # [T, E] probability each expert is cached
    occupancy = np.concatenate([[0.0], filled.sum(1), [len(rates)]])
    hit = np.concatenate([[0.0], filled @ rates / rates.sum(), [1.0]])
    return occupancy, hit


def lru_hit_rate(selection_freq: np.ndarray, cache_slots: int, repeat_rate: float = 0.0) -> float:
    """Expected share of selections of these experts that find them in an LRU cache of ``cache_slots``.

    ``selection_freq[e]``: fraction of tokens that route to expert e (the experts competing for the
    cache, i.e. not pinned); ``repeat_rate``: fraction of tokens whose expert set equals the
    previous token's.
    """
    rates = np.asarray(selection_freq, dtype=np.float64)
    rates = rates[rates > 0]
    total_rate = float(rates.sum())
    if total_rate <= 0 or cache_slots <= 0:
        return 0.0
    if cache_slots >= len(rates):
        return 1.0
    requests_per_token = max(1, int(round(total_rate)))

    occupancy, hit = _che_curve(rates)

    def che_hit(capacity: float) -> float:
        return float(np.interp(capacity, occupancy, hit)) if capacity > 0 else 0.0

    independent_hit = 0.0
    for _ in range(50):  # fixed point: hits among a token's earlier requests evict nothing
        updated = float(np.mean([che_hit(cache_slots - j * (1.0 - independent_hit)) for j in range(requests_per_token)]))
        if abs(updated - independent_hit) < 1e-9:
            break
        independent_hit = updated
    repeat_hit = min(1.0, cache_slots / total_rate)  # a repeated set hits if the cache holds it
    repeat_rate = min(max(float(repeat_rate), 0.0), 1.0)
    return repeat_rate * repeat_hit + (1.0 - repeat_rate) * independent_hit
