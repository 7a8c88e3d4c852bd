"""MoE expert offloading: per-layer LRU expert caches on the GPU tier, speculative prefetch of the
next layer's experts, and CPU compute of missing experts when the cost model says so (Fiddler).

Example::

    from online.experts import ExpertRuntime
    runtime = ExpertRuntime(cfg, ffn_layers, tier, weight_format="fp32", slots=2, prefetch=True)
    executor.attach_experts(runtime)     # HybridExecutor routes MoE layers through it
"""
from .cache import ExpertCache
from .cost import MissCostModel
from .packing import ExpertLayout, PackedExpert, pack_expert, tier_forward
from .prefetch import Prefetcher
from .runtime import MISS_POLICIES, ExpertRuntime, default_cost_model, tier_bytes_needed

__all__ = ["ExpertCache", "ExpertLayout", "ExpertRuntime", "MISS_POLICIES", "MissCostModel", "PackedExpert",
           "Prefetcher", "default_cost_model", "pack_expert", "tier_bytes_needed", "tier_forward"]
