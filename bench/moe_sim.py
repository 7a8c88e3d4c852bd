"""Replaying MoE routing traces through the runtime's expert cache and prefetcher, and Belady's bound.

A :class:`RoutingTrace` holds, per MoE layer, each token's selected experts and the guess made for
that layer one layer earlier. ``simulate`` drives the real :class:`online.experts.ExpertCache`
(LRU, copy on every miss, as mixtral-offloading) and :class:`online.experts.Prefetcher` over it,
token by token in decode order, with a no-op copier; ``belady`` is the offline optimum (MIN: on a
miss with a full cache evict the expert whose next request is farthest away) for the same number
of slots, the best any demand-fetching policy can do without prefetch.

Example::

    result = simulate(trace, slots=4, prefetch=True)
    result["hit_rate"], result["recall"], result["copies_per_token"]
    belady(trace, slots=4)["hit_rate"]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from online.execution.gpu_tier import GpuTier
from tandem.core.ffn.weights import MoELayerWeights
from online.experts.cache import ExpertCache
from online.experts.prefetch import Prefetcher


@dataclass
class RoutingTrace:
    name: str
    ids: list[torch.Tensor]  # per MoE layer: [N, k] experts chosen by each token (decode order)
    guesses: list[torch.Tensor | None]  # per MoE layer: [N, k] guessed one layer earlier (None for the first)
    num_experts: int
    expert_nbytes: int  # one expert, packed (what a cache copy moves)
    d_model: int
    notes: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.ids[0].shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.ids)

    @property
    def top_k(self) -> int:
        return int(self.ids[0].shape[1])


class NullCopier:
    """Copies nothing: the simulation only needs the cache's bookkeeping."""

    def copy(self, slot_key, dst, src):
        return None

    def wait(self, handle) -> None:
        return None

    def mark_read(self, slot_key) -> None:
        return None


def simulate(trace: RoutingTrace, slots: int, prefetch: bool) -> dict:
    """Hit rate, copies and prefetch quality of LRU (+ prefetch) with ``slots`` per layer."""
    tier = GpuTier(torch.device("cpu"), budget_bytes=1 << 40)
    n_layers, n_tokens = trace.num_layers, trace.num_tokens
    caches = {i: ExpertCache(i, slots, 1, tier, NullCopier()) for i in range(n_layers)}
    hosts = {i: [SimpleNamespace(host=torch.zeros(1, dtype=torch.uint8))] * trace.num_experts for i in range(n_layers)}
    step = {"t": 0}
    fake_layers = [MoELayerWeights(router=torch.empty(0), experts=[]) for _ in range(n_layers)]
    prefetcher = None
    if prefetch:
        prefetcher = Prefetcher(None, fake_layers, guesser=lambda target, x: trace.guesses[target][step["t"]:step["t"] + 1])
    ids_lists = [ids.tolist() for ids in trace.ids]
    for t in range(n_tokens):
        step["t"] = t
        for i in range(n_layers):
            cache = caches[i]
            if prefetcher is not None:
                prefetcher.evaluate(i, trace.ids[i][t:t + 1])
            needed = sorted(set(ids_lists[i][t]))
            misses = [e for e in needed if not cache.lookup(e)]
            for e in misses:
                if slots:
                    cache.insert(e, hosts[i][e].host)
            if prefetcher is not None:
                prefetcher.issue(i, None, caches, hosts)
    hits = sum(c.hits for c in caches.values())
    lookups = hits + sum(c.misses for c in caches.values())
    copies = sum(c.copies for c in caches.values())
    out = {"hit_rate": hits / lookups, "copies_per_token": copies / n_tokens,
           "demand_copies_per_token": (copies - (prefetcher.copies if prefetcher else 0)) / n_tokens}
    if prefetcher is not None:
        out.update(recall=prefetcher.recall, precision=prefetcher.precision,
                   prefetch_copies_per_token=prefetcher.copies / n_tokens)
    return out


def _transitions(needed: int, slots: int, states: list[int], index: dict[int, int]) -> tuple:
    """Edges (from state, to state, hits) of one token whose experts are the bitmask ``needed``:
    hits are the needed experts already cached; every miss is copied in (occupying a slot at least
    until the next copy), so the new contents are any ``min(slots, |cache + misses|)`` of
    cache + misses that keep at least one miss; with no miss the contents stay."""
    src, dst, gain = [], [], []
    for c in states:
        misses = needed & ~c
        hits = bin(needed & c).count("1")
        if not misses:
            src.append(index[c]), dst.append(index[c]), gain.append(hits)
            continue
        union = c | needed
        size = min(slots, bin(union).count("1"))
        sub = union
        while sub:
            if bin(sub).count("1") == size and sub & misses:
                src.append(index[c]), dst.append(index[sub]), gain.append(hits)
            sub = (sub - 1) & union
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(gain, dtype=np.float64)


def belady(trace: RoutingTrace, slots: int) -> dict:
    """The offline optimum (Belady's bound) for demand caching with ``slots`` per layer: the most
    hits any policy that knows the whole trace can get when every missing expert must be copied in
    and a token's experts are looked up together. Computed exactly by dynamic programming over cache
    contents (Belady's farthest-next-use rule is not exact when several experts arrive at once)."""
    if slots <= 0:
        return {"hit_rate": 0.0, "copies_per_token": 0.0}
    n_experts = trace.num_experts
    states = [m for m in range(1 << n_experts) if bin(m).count("1") <= slots]
    index = {m: i for i, m in enumerate(states)}
    edges: dict[int, tuple] = {}
    hits = lookups = 0
    for ids in trace.ids:
        best = np.full(len(states), -np.inf)
        best[index[0]] = 0.0
        for row in ids.tolist():
            needed = sum(1 << e for e in set(row))
            lookups += bin(needed).count("1")
            if needed not in edges:
                edges[needed] = _transitions(needed, slots, states, index)
            src, dst, gain = edges[needed]
            nxt = np.full(len(states), -np.inf)
            np.maximum.at(nxt, dst, best[src] + gain)
            best = nxt
        hits += int(best.max())
    return {"hit_rate": hits / lookups, "copies_per_token": (lookups - hits) / trace.num_tokens if slots else 0.0}


def exhaustive_optimum(steps: list[list[int]], slots: int) -> int:
    """Most hits by trying every eviction choice in every insertion order (small traces only):
    the check of ``belady``."""
    from itertools import permutations
    best = 0

    def run(s: int, cache: frozenset, hits: int) -> None:
        nonlocal best
        if s == len(steps):
            best = max(best, hits)
            return
        misses = [e for e in steps[s] if e not in cache]
        gained = hits + len(steps[s]) - len(misses)
        if not slots:
            return run(s + 1, cache, gained)
        finals: set[frozenset] = set()

        def insert(order: tuple, i: int, current: frozenset) -> None:
            if i == len(order):
                finals.add(current)
            elif len(current) < slots:
                insert(order, i + 1, current | {order[i]})
            else:
                for victim in current:
                    insert(order, i + 1, (current - {victim}) | {order[i]})
        for order in permutations(misses):
            insert(order, 0, cache)
        for final in finals:
            run(s + 1, final, gained)
    run(0, frozenset(), 0)
    return best


def trace_statistics(trace: RoutingTrace) -> dict:
    """Expert load skew and temporal locality of the trace (averaged over layers)."""
    kept, top_share = [], []
    for ids in trace.ids:
        onehot = torch.zeros(ids.shape[0], trace.num_experts)
        onehot.scatter_(1, ids, 1.0)
        kept.append(float((onehot[1:] * onehot[:-1]).sum() / (onehot[1:].sum())))
        freq = onehot.mean(0).sort(descending=True).values
        top_share.append(float(freq[: trace.num_experts // 4].sum() / freq.sum()))
    return {"kept_rate": sum(kept) / len(kept), "top_quarter_load": sum(top_share) / len(top_share)}
