"""The GPU step's kernel latency for the cost model (``HardwareProfile.gpu_launch_s``): a CUDA graph of
the step's own norm-fused Q4_1 matvec at a small model's shape, replayed; seconds per kernel.

Example::

    measure_launch_seconds()      # ~4.6e-6 on an H100 (0.0 without CUDA or Triton)
"""
from __future__ import annotations

import statistics
import time

import torch

KERNELS_PER_GRAPH = 120
SHAPE = (576, 576)  # SmolLM2's hidden size: decode kernels this small are latency-bound


def measure_launch_seconds(repeats: int = 20) -> float:
    """Seconds per kernel, or 0.0 (not modeled) without CUDA or Triton, or when the measurement fails
    (a warning says why)."""
    if not torch.cuda.is_available():
        return 0.0
    try:
        import triton  # noqa: F401
    except ImportError:
        return 0.0
    try:
        return _measure(repeats)
    except Exception as exc:  # noqa: BLE001 - a driver or compiler failure must not end the probe
        import warnings
        warnings.warn(f"GPU-step kernel latency not measured ({type(exc).__name__}: {exc}); gpu_launch_s = 0")
        return 0.0


def _measure(repeats: int) -> float:
    from ..execution.gpu_tier import GpuTier
    from ..execution.tier_matrix import TierMatrix
    from .ops import Mat, Ops
    tier = GpuTier.create(1 << 30, "cuda")
    w = Mat.of(TierMatrix.pack(torch.randn(*SHAPE), "q4_1", tier, "probe"))
    ops = Ops("triton")
    x = torch.randn(SHAPE[1], device="cuda")
    norm = torch.ones(SHAPE[1], device="cuda")
    y = torch.zeros(SHAPE[0], device="cuda")

    return graph_seconds_per_launch(lambda: ops.matvec(x, w, y, norm=norm, eps=1e-5, residual=y), KERNELS_PER_GRAPH,
                                    repeats)


def graph_seconds_per_launch(launch, launches: int, repeats: int = 20) -> float:
    """Median seconds per call of ``launch`` (one kernel), replayed as a CUDA graph of ``launches`` calls (the
    first call, outside the graph, compiles)."""
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / launches
