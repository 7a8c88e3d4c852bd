"""The one roofline: a unit of work costs the larger of its memory time and its compute time.

Used by the planner's cost model (``placement.cost_model``) and the runtime's expert-miss rule
(``online.experts.cost``), so both decide with the same formula.

Example::

    roofline_seconds(read_bytes=2e9, flop_count=4e9, bandwidth_bytes_per_s=1e12, flops_per_s=80e12)  # 0.002
"""
from __future__ import annotations

import numpy as np


def roofline_seconds(read_bytes, flop_count, bandwidth_bytes_per_s: float, flops_per_s: float):
    """``max(read_bytes / bandwidth, flop_count / flops)``; scalars give a float, arrays an array.

    A device with no bandwidth or no compute (a GPU that is not there) costs infinity.
    """
    if bandwidth_bytes_per_s <= 0 or flops_per_s <= 0:
        return float("inf") if np.isscalar(read_bytes) else np.full(np.shape(read_bytes), np.inf)
    seconds = np.maximum(np.divide(read_bytes, bandwidth_bytes_per_s), np.divide(flop_count, flops_per_s))
    return float(seconds) if np.ndim(seconds) == 0 else seconds
