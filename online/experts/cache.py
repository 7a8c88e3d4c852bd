"""Per-layer expert cache on the GPU tier: pinned experts + LRU slots, every byte charged to the tier.

Each slot is one buffer of ``expert_nbytes`` (every expert of a layer packs to the same size), so
a swap is one copy of the expert's packed buffer into the victim's slot. Pinned experts get their
own buffers at load time and are never evicted. Slots are allocated once, up front, from the
:class:`~online.execution.gpu_tier.GpuTier`, so the tier's budget can never be exceeded later.

LRU order: ``lookup`` of a cached expert makes it the most recently used; ``insert`` evicts the
least recently used expert (``choose_victim``), unless a slot is still free, and makes the new
expert the most recently used. Pinned experts are hits but take no part in the LRU order.

Example::

    cache = ExpertCache(layer=3, num_slots=2, expert_nbytes=packed.nbytes, tier=tier,
                        copier=make_copier(tier), pinned={0: experts[0].host})
    if cache.lookup(5) is None:                  # a miss (counted)
        cache.insert(5, experts[5].host)         # one copy; evicts the LRU expert if full
    buf = cache.ready_buffer(5)                  # waits for the copy; [nbytes] uint8 on the tier
    cache.hits, cache.misses
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import torch

from tandem.core.errors import TandemError
from ..execution.gpu_tier import GpuTier


class ExpertCache:
    def __init__(self, layer: int, num_slots: int, expert_nbytes: int, tier: GpuTier, copier,
                 pinned: dict[int, torch.Tensor] | None = None) -> None:
        if num_slots < 0:
            raise TandemError(f"expert cache slots must be >= 0, got {num_slots}")
        pinned = pinned or {}
        need = (num_slots + len(pinned)) * expert_nbytes
        if not tier.can_allocate(need):
            raise TandemError(f"GPU budget too small for layer {layer}'s experts: {len(pinned)} pinned + {num_slots} "
                              f"cache slots need {need} bytes, {tier.free_bytes} of {tier.budget_bytes} free; "
                              "lower --expert-slots or raise --gpu-budget")
        self.layer = layer
        self.expert_nbytes = expert_nbytes
        self.tier = tier
        self.copier = copier
        self._pinned = {e: tier.allocate(f"experts.{layer}.pinned.{e}", host) for e, host in sorted(pinned.items())}
        self._slots = [tier.allocate(f"experts.{layer}.slot.{j}",
                                     torch.empty(expert_nbytes, dtype=torch.uint8, device=tier.device))
                       for j in range(num_slots)]  # [nbytes] uint8 each, charged to the tier
        self._lru: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self._free = list(range(num_slots))[::-1]  # pop() hands out slot 0 first
        self._pending: dict[int, object] = {}  # slot -> copy handle not yet waited for
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.copies = 0
        self.bytes_copied = 0

    # --- state ---------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def pinned(self) -> frozenset[int]:
        return frozenset(self._pinned)

    def cached(self) -> list[int]:
        """Experts in the LRU slots, least recently used first."""
        return list(self._lru)

    def contains(self, expert: int) -> bool:
        return expert in self._pinned or expert in self._lru

    # --- LRU -----------------------------------------------------------------------------------
    def mark_used(self, expert: int) -> None:
        if expert in self._lru:
            self._lru.move_to_end(expert)

    def lookup(self, expert: int) -> bool:
        """Count a request for ``expert``: True (a hit, now most recently used) or False (a miss)."""
        if self.contains(expert):
            self.hits += 1
            self.mark_used(expert)
            return True
        self.misses += 1
        return False

    def choose_victim(self, exclude: Iterable[int] = ()) -> int | None:
        """The expert an insert would evict: None while a slot is free; the least recently used
        expert not in ``exclude`` otherwise (None as well when every cached expert is excluded)."""
        if self._free:
            return None
        excluded = set(exclude)
        return next((e for e in self._lru if e not in excluded), None)

    def can_insert(self, exclude: Iterable[int] = ()) -> bool:
        return bool(self._free) or self.choose_victim(exclude) is not None

    def insert(self, expert: int, host: torch.Tensor, exclude: Iterable[int] = ()) -> int | None:
        """Copy ``expert``'s packed buffer into a slot (asynchronously); returns the evicted expert."""
        if self.contains(expert):
            raise TandemError(f"internal error: expert {expert} of layer {self.layer} is already cached")
        if host.numel() != self.expert_nbytes:
            raise TandemError(f"internal error: expert buffer of {host.numel()} bytes, slots hold {self.expert_nbytes}")
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = self.choose_victim(exclude)
            if victim is None:
                raise TandemError(f"internal error: no evictable slot in layer {self.layer}")
            slot = self._lru.pop(victim)
            self.evictions += 1
        self._pending[slot] = self.copier.copy((self.layer, slot), self._slots[slot], host)
        self._lru[expert] = slot
        self.copies += 1
        self.bytes_copied += self.expert_nbytes
        return victim

    # --- compute access ------------------------------------------------------------------------
    def ready_buffer(self, expert: int) -> torch.Tensor:
        """The expert's buffer on the tier, once its copy (if any) has landed."""
        if expert in self._pinned:
            return self._pinned[expert]
        slot = self._lru[expert]
        self.copier.wait(self._pending.pop(slot, None))
        return self._slots[slot]

    def finished_reading(self, expert: int) -> None:
        """After compute on ``expert``'s slot: later copies into that slot wait for it."""
        if expert in self._lru:
            self.copier.mark_read((self.layer, self._lru[expert]))

    def drain(self) -> None:
        """Wait for every outstanding copy."""
        for slot in list(self._pending):
            self.copier.wait(self._pending.pop(slot))
