"""The miss decision: copy a missing expert to the GPU tier, or compute it on the CPU (Fiddler).

Copying costs the expert's bytes over host-to-device bandwidth, then the tier's compute (and the
routed tokens' activations crossing twice); computing on the CPU reads the expert at CPU memory
bandwidth (or is bound by CPU flops when many tokens are routed to it). The cheaper side wins;
this is the per-token form of the rule ``placement.problem`` plans with.

On a CPU tier (no GPU) the "copy" is a memcpy within host memory (read + write at CPU bandwidth)
and the tier computes at CPU speed, so computing in place always wins: misses run where the
expert lives and the cache fills only through prefetch and pinning.

Example::

    cost = MissCostModel.from_hardware(load_hardware("t4"))
    cost.should_copy(expert_nbytes=176_160_768, n_params=176_160_768, n_tokens=1, d_model=4096)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.core.errors import TandemError
from tandem.core.roofline import roofline_seconds

ACTIVATION_BYTES = 4  # float32 hidden states


@dataclass(frozen=True)
class MissCostModel:
    h2d_bytes_per_s: float
    tier_bytes_per_s: float
    tier_flops: float
    cpu_bytes_per_s: float
    cpu_flops: float
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("tier_bytes_per_s", "tier_flops", "cpu_bytes_per_s", "cpu_flops"):
            if not getattr(self, key) > 0:
                raise TandemError(f"miss cost model: {key} must be positive")
        if self.h2d_bytes_per_s < 0:
            raise TandemError("miss cost model: h2d_bytes_per_s must be >= 0")

    @classmethod
    def from_hardware(cls, hw) -> "MissCostModel":
        """A HardwareProfile's numbers (a preset, a probe, or a plan's hardware)."""
        if not hw.has_gpu:
            return cls.cpu_tier(hw.cpu_bandwidth_bytes_per_s, hw.cpu_matmul_flops, source=f"{hw.name} (no GPU)")
        return cls(h2d_bytes_per_s=hw.h2d_bandwidth_bytes_per_s, tier_bytes_per_s=hw.gpu_bandwidth_bytes_per_s,
                   tier_flops=hw.gpu_matmul_flops, cpu_bytes_per_s=hw.cpu_bandwidth_bytes_per_s,
                   cpu_flops=hw.cpu_matmul_flops, source=hw.name)

    @classmethod
    def cpu_tier(cls, cpu_bytes_per_s: float, cpu_flops: float, source: str = "cpu tier") -> "MissCostModel":
        """The tier is host memory: a copy reads and writes every byte, compute runs on the CPU."""
        return cls(h2d_bytes_per_s=cpu_bytes_per_s / 2, tier_bytes_per_s=cpu_bytes_per_s, tier_flops=cpu_flops,
                   cpu_bytes_per_s=cpu_bytes_per_s, cpu_flops=cpu_flops, source=source)

    @staticmethod
    def _compute_s(nbytes: int, n_params: int, n_tokens: int, bandwidth: float, flops: float) -> float:
        return roofline_seconds(nbytes, 2.0 * n_params * n_tokens, bandwidth, flops)

    def copy_seconds(self, expert_nbytes: int, n_params: int, n_tokens: int, d_model: int) -> float:
        if self.h2d_bytes_per_s <= 0:
            return math.inf
        activations = 2 * n_tokens * d_model * ACTIVATION_BYTES  # x over, y back
        return ((expert_nbytes + activations) / self.h2d_bytes_per_s
                + self._compute_s(expert_nbytes, n_params, n_tokens, self.tier_bytes_per_s, self.tier_flops))

    def cpu_seconds(self, expert_nbytes: int, n_params: int, n_tokens: int) -> float:
        return self._compute_s(expert_nbytes, n_params, n_tokens, self.cpu_bytes_per_s, self.cpu_flops)

    def should_copy(self, expert_nbytes: int, n_params: int, n_tokens: int, d_model: int) -> bool:
        return (self.copy_seconds(expert_nbytes, n_params, n_tokens, d_model)
                < self.cpu_seconds(expert_nbytes, n_params, n_tokens))
