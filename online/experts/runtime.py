"""ExpertRuntime: the MoE layer forward with an expert cache on the GPU tier.

Per MoE layer and call: route (float router, exactly as DenseExecutor); look every selected
expert up in the layer's cache (ascending expert id; hits become most recently used); compute the
hits on the tier; for each miss decide (``miss_policy``): copy it into the cache (one copy of its
packed buffer, LRU eviction) and compute it on the tier, or compute it on the CPU where it lives
(Fiddler). While the copies and CPU work run, the next MoE layer's likely experts are prefetched.
Outputs are added in ascending expert order with the router weights, then the shared expert
(Qwen2-MoE), exactly as ``DenseExecutor.moe_forward``: the result does not depend on the cache.

Example::

    runtime = ExpertRuntime(cfg, ffn_layers, GpuTier.create(1 << 30), weight_format="fp32",
                            slots=2, prefetch=True)
    y = runtime.forward(layer, x)      # x [T, d] -> [T, d]
    runtime.counters()                 # hits, misses, bytes copied, ... (cumulative)
"""
from __future__ import annotations

from typing import Sequence

import torch

from placement.hardware import PRESETS
from tandem.core.errors import TandemError
from tandem.core.config import ModelConfig
from tandem.core.ffn.dense import combine_experts, gated_shared, route, shared_expert_out, tokens_by_expert
from tandem.core.tier_format import expert_layout_bytes
from ..execution.gpu_tier import GpuTier
from tandem.core.ffn.weights import MoELayerWeights
from .cache import ExpertCache
from .copier import make_copier
from .cost import MissCostModel
from .block_experts import expert_blocks_of, pack_ffn, packable
from .packing import PackedExpert, block_format, expert_blocks, pack_expert, tier_forward
from .prefetch import Guesser, Prefetcher

MISS_POLICIES = ("auto", "copy", "cpu")  # cost model | always copy (mixtral-offloading) | always CPU
ACTIVATION_BYTES = 4


def default_cost_model(tier: GpuTier, hardware=None) -> MissCostModel:
    """The plan's hardware when there is one; else the rtx4090 preset on CUDA, host memory on a CPU tier."""
    if hardware is not None:
        return MissCostModel.from_hardware(hardware)
    if tier.is_cuda:
        return MissCostModel.from_hardware(PRESETS["rtx4090"])
    cpu = PRESETS["cpu-only"]
    return MissCostModel.cpu_tier(cpu.cpu_bandwidth_bytes_per_s, cpu.cpu_matmul_flops, source="cpu tier (cpu-only preset)")


def _per_layer(value, cfg: ModelConfig, what: str) -> list[int]:
    if value is None:
        return [0] * cfg.num_layers
    if isinstance(value, int):
        values = [value] * cfg.num_layers
    else:
        values = [int(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]
    if len(values) != cfg.num_layers or any(v < 0 for v in values):
        raise TandemError(f"{what} must be >= 0 for each of the {cfg.num_layers} layers, got {values}")
    return values


def _compact(values: list[int]) -> int | list[int]:
    return values[0] if len(set(values)) == 1 else values


def tier_bytes_needed(cfg: ModelConfig, layer_weights: list, weight_format: str,
                      slots: int | Sequence[int] | None, pinned=None, raw: dict | None = None) -> int:
    """GPU-tier bytes an ExpertRuntime with these settings (and the checkpoint's GGUF ``raw``) allocates."""
    slots_per_layer, pinned_per_layer = _per_layer(slots, cfg, "expert cache slots"), _pinned_sets(pinned, cfg)
    total = 0
    for i, w in enumerate(layer_weights):
        if isinstance(w, MoELayerWeights):
            blocks = expert_blocks(raw, i, 0, weight_format)
            n_ff, d = w.experts[0].up.shape  # the layout pack_expert makes, from shapes (nothing decoded)
            expert_nbytes = expert_layout_bytes(d, n_ff, w.experts[0].gate is not None, weight_format,
                                                bias=cfg.mlp_bias, file_blocks=block_format(blocks))
            n_pinned = len(pinned_per_layer[i])
            total += (min(slots_per_layer[i], len(w.experts) - n_pinned) + n_pinned) * expert_nbytes
    return total


def _pinned_sets(pinned, cfg: ModelConfig) -> list[list[int]]:
    if pinned is None:
        return [[] for _ in range(cfg.num_layers)]
    rows = pinned.tolist() if hasattr(pinned, "tolist") else list(pinned)
    if len(rows) != cfg.num_layers:
        raise TandemError(f"pinned experts must list {cfg.num_layers} layers, got {len(rows)}")
    out = []
    for row in rows:
        if len(row) == cfg.num_experts and all(isinstance(v, bool) for v in row):  # a [L, E] mask
            out.append([e for e, keep in enumerate(row) if keep])
        else:
            out.append(sorted(int(e) for e in row))
    return out


class ExpertRuntime:
    def __init__(self, cfg: ModelConfig, layer_weights: list, tier: GpuTier, *, weight_format: str = "fp32",
                 slots: int | Sequence[int] | None = 0, pinned=None, prefetch: bool = True,
                 miss_policy: str = "auto", cost_model: MissCostModel | None = None, threads: int = 2,
                 guesser: Guesser | None = None, fit_to_budget: bool = False, raw: dict | None = None) -> None:
        """``raw``: the checkpoint's GGUF tensors, whose experts' blocks int4 / int8 keep (packing.py)."""
        if miss_policy not in MISS_POLICIES:
            raise TandemError(f"unknown miss policy {miss_policy!r} (choose from {', '.join(MISS_POLICIES)})")
        slots_per_layer = _per_layer(slots, cfg, "expert cache slots")
        pinned_per_layer = _pinned_sets(pinned, cfg)
        self.cfg, self.tier, self.weight_format, self.miss_policy = cfg, tier, weight_format, miss_policy
        self.cost = cost_model or default_cost_model(tier)
        self.copier = make_copier(tier)
        self.moe: dict[int, MoELayerWeights] = {}
        self.tier_shared: dict = {}  # layer -> shared expert on the GPU tier (tier_units.place_shared_experts)
        self.cpu_shared: dict = {}  # layer -> the shared expert packed for the CPU (a QuantizedFFN; else float)
        self.packed: dict[int, list[PackedExpert]] = {}
        self.caches: dict[int, ExpertCache] = {}
        gated = cfg.mlp_gated
        self.expert_params = (3 if gated else 2) * cfg.moe_intermediate_size * cfg.hidden_size
        for i, w in enumerate(layer_weights):
            if not isinstance(w, MoELayerWeights):
                continue
            bad = [e for e in pinned_per_layer[i] if not 0 <= e < len(w.experts)]
            if bad:
                raise TandemError(f"pinned expert {bad[0]} out of range in layer {i} ({len(w.experts)} experts)")
            self.packed[i] = [pack_expert(cfg, e, weight_format, threads, pin=tier.is_cuda,
                                          blocks=expert_blocks(raw, i, j, weight_format))
                              for j, e in enumerate(w.experts)]
            shared = w.shared_expert
            if shared is not None and weight_format in ("int4", "int8") and packable(shared):  # as block_experts
                self.cpu_shared[i] = pack_ffn(cfg, shared, expert_blocks_of(raw, i), weight_format, threads)
                shared = None
            self.moe[i] = MoELayerWeights(router=w.router, experts=[], shared_expert=shared,
                                          shared_expert_gate=w.shared_expert_gate)
        if not self.moe:
            raise TandemError("the expert cache needs a MoE model; this model has no experts")
        slots_wanted = {i: min(slots_per_layer[i], len(self.packed[i]) - len(pinned_per_layer[i])) for i in self.moe}
        if fit_to_budget:
            slots_wanted = self._fit_slots(slots_wanted, pinned_per_layer)
        for i in self.moe:
            self.caches[i] = ExpertCache(i, slots_wanted[i], self.packed[i][0].nbytes, tier, self.copier,
                                         pinned={e: self.packed[i][e].host for e in pinned_per_layer[i]})
        self.prefetcher = Prefetcher(cfg, layer_weights, guesser) if prefetch else None
        self.cpu_expert_tokens = 0  # (token, expert) pairs computed on the CPU
        self.tier_expert_tokens = 0  # (token, expert) pairs computed on the tier
        self.activation_bytes = 0  # hidden states sent to the tier and results sent back

    def _fit_slots(self, slots: dict[int, int], pinned: list[list[int]]) -> dict[int, int]:
        """Fewer slots (largest layers first) until pinned experts + slots fit the tier's free bytes
        (a plan counts bytes per weight; packed experts may be a little larger than it assumed)."""
        slots = dict(slots)
        nbytes = {i: self.packed[i][0].nbytes for i in slots}

        def need() -> int:
            return sum((slots[i] + len(pinned[i])) * nbytes[i] for i in slots)
        while need() > self.tier.free_bytes and any(slots.values()):
            largest = max(slots, key=lambda i: (slots[i], -i))
            slots[largest] -= 1
        return slots

    # --- execution -----------------------------------------------------------------------------
    def _copy_on_miss(self, cache: ExpertCache, n_tokens: int) -> bool:
        if cache.num_slots == 0 or self.miss_policy == "cpu":
            return False
        if self.miss_policy == "copy":
            return True
        return self.cost.should_copy(cache.expert_nbytes, self.expert_params, n_tokens, self.cfg.hidden_size)

    @torch.inference_mode()
    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] (the layer's normalized FFN input, host float32) -> [T, d]."""
        moe, cache, packed = self.moe[layer], self.caches[layer], self.packed[layer]
        expert_ids, weights, _ = route(self.cfg, moe, x)  # [T, k]
        if self.prefetcher is not None:
            self.prefetcher.evaluate(layer, expert_ids)
        routed = tokens_by_expert(expert_ids)  # e (ascending) -> (token idx [n], rank [n])
        needed = list(routed)
        hits = [e for e in needed if cache.lookup(e)]
        results: dict[int, torch.Tensor] = {}
        x_tier: list[torch.Tensor] = []

        def on_tier(e: int) -> None:
            if not x_tier:
                x_tier.append(x.to(self.tier.device, non_blocking=True))
                self.activation_bytes += x.numel() * ACTIVATION_BYTES
            token_idx = routed[e][0]
            rows = x_tier[0][token_idx.to(self.tier.device)]  # [n, d]
            results[e] = tier_forward(self.cfg, packed[e].layout, cache.ready_buffer(e), rows)  # [n, d]
            cache.finished_reading(e)
            self.tier_expert_tokens += token_idx.numel()
            self.activation_bytes += token_idx.numel() * x.shape[1] * ACTIVATION_BYTES

        for e in hits:
            on_tier(e)
        misses = [e for e in needed if e not in results]  # ascending
        copied, to_cpu = [], []
        for e in misses:
            if not self._copy_on_miss(cache, routed[e][0].numel()):
                to_cpu.append(e)
                continue
            victim = cache.choose_victim()
            if victim in copied and victim not in results:
                on_tier(victim)  # its slot is about to be reused: compute it first
            cache.insert(e, packed[e].host)
            copied.append(e)
        if self.prefetcher is not None:
            self.prefetcher.issue(layer, x, self.caches, self.packed)
        for e in to_cpu:  # overlaps the copies above
            token_idx = routed[e][0]
            results[e] = packed[e].cpu_forward(x[token_idx])  # [n, d]
            self.cpu_expert_tokens += token_idx.numel()
        for e in copied:
            if e not in results:
                on_tier(e)
        out = combine_experts(x, routed, results, weights)  # [T, d]
        if layer in self.tier_shared:  # on the GPU tier (tier_units.TierSharedExpert)
            out = out + self.tier_shared[layer](x)
        elif layer in self.cpu_shared:
            y = torch.from_numpy(self.cpu_shared[layer].forward_numpy(x.contiguous().numpy())[0])  # [T, d]
            out = out + gated_shared(x, moe.shared_expert_gate, y)
        elif moe.shared_expert is not None:
            out = out + shared_expert_out(self.cfg, moe, x)
        return out

    # --- accounting ----------------------------------------------------------------------------
    def count_fused(self, n_tokens: int) -> None:
        """Experts a fused CPU step ran on ``n_tokens`` tokens (fused_arch.check_moe lets it run only where no
        expert is on the tier): top_k per token and MoE layer, each a miss computed on the CPU."""
        per_layer = n_tokens * self.cfg.num_experts_per_tok
        for cache in self.caches.values():
            cache.misses += per_layer
        self.cpu_expert_tokens += per_layer * len(self.caches)

    def counters(self) -> dict[str, int]:
        """Cumulative counts (the Engine turns deltas into per-generation stats)."""
        caches = self.caches.values()
        p = self.prefetcher
        return {"hits": sum(c.hits for c in caches), "misses": sum(c.misses for c in caches),
                "copies": sum(c.copies for c in caches), "bytes_copied": sum(c.bytes_copied for c in caches),
                "evictions": sum(c.evictions for c in caches), "activation_bytes": self.activation_bytes,
                "cpu_expert_tokens": self.cpu_expert_tokens, "tier_expert_tokens": self.tier_expert_tokens,
                "prefetch_copies": p.copies if p else 0, "prefetch_copies_used": p.copies_used if p else 0,
                "guessed_hits": p.guessed_hits if p else 0, "guessed_total": p.guessed_total if p else 0}

    def stats(self, delta: dict[str, int], tokens: int) -> dict:
        """Per-generation stats from a counters() delta over ``tokens`` processed tokens."""
        tokens = max(tokens, 1)
        lookups = delta["hits"] + delta["misses"]
        on = self.prefetcher is not None
        return {
            "expert_hit_rate": round(delta["hits"] / lookups, 4) if lookups else 0.0,
            "prefetch_recall": (round(delta["guessed_hits"] / delta["guessed_total"], 4)
                                if on and delta["guessed_total"] else None),
            "prefetch_precision": (round(delta["prefetch_copies_used"] / delta["prefetch_copies"], 4)
                                   if on and delta["prefetch_copies"] else None),
            "experts_cpu_per_token": round(delta["cpu_expert_tokens"] / tokens, 3),
            "experts_gpu_per_token": round(delta["tier_expert_tokens"] / tokens, 3),
            "expert_copies_per_token": round(delta["copies"] / tokens, 3),
            "expert_bytes_moved": delta["bytes_copied"] + delta["activation_bytes"],
            "expert_cache_slots": _compact([c.num_slots for c in self.caches.values()]),
            "prefetch": on,
        }

    @property
    def nbytes(self) -> int:
        """Host bytes of the packed experts, routers and shared experts."""
        total = sum(p.nbytes for experts in self.packed.values() for p in experts)
        for w in self.moe.values():
            total += w.router.numel() * w.router.element_size()
            total += w.shared_expert.nbytes if w.shared_expert is not None else 0
        return total + sum(q.nbytes for q in self.cpu_shared.values())


    def close(self) -> None:
        for cache in self.caches.values():
            cache.drain()
        self.copier.close()
