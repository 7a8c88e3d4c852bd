"""The roofline: a piece of work costs max(bytes moved / bandwidth, flops / compute rate).

The one formula behind the placement cost model (placement/cost_model.py) and the expert cache's
copy-or-compute decision (online/experts/cost.py). Scalars or numpy arrays (elementwise).

Example::

    roofline_seconds(nbytes=2e9, flop_count=2e9, bandwidth_bytes_per_s=50e9, flops_per_s=1e12)  # 0.04
"""
from __future__ import annotations

import numpy as np


def roofline_seconds(nbytes, flop_count, bandwidth_bytes_per_s, flops_per_s):
    """max(nbytes / bandwidth, flop_count / flops_per_s); a float for scalars, an array for arrays."""
    seconds = np.maximum(np.divide(nbytes, bandwidth_bytes_per_s), np.divide(flop_count, flops_per_s))
    return float(seconds) if np.ndim(seconds) == 0 else seconds
