"""One roofline: the placement cost model and the expert cache's decision both price work through it."""
from __future__ import annotations

import numpy as np

from online.experts.cost import MissCostModel
from placement.cost_model import weight_seconds
from tandem.roofline import roofline_seconds


def test_roofline_is_the_slower_of_memory_and_compute():
    assert roofline_seconds(2e9, 1e9, 50e9, 1e12) == 2e9 / 50e9  # memory-bound
    assert roofline_seconds(1e3, 1e12, 50e9, 1e12) == 1.0  # compute-bound
    got = roofline_seconds(np.array([1e9, 4e9]), np.array([1e12, 1.0]), 1e9, 1e12)
    np.testing.assert_array_equal(got, [max(1e9 / 1e9, 1e12 / 1e12), max(4e9 / 1e9, 1.0 / 1e12)])


def test_placement_and_experts_agree_on_the_same_work():
    nbytes, bytes_per_weight, bandwidth, flops = 3_000_000, 0.5625, 20e9, 200e9
    n_params = int(nbytes / bytes_per_weight)
    cpu = MissCostModel.cpu_tier(cpu_bytes_per_s=bandwidth, cpu_flops=flops)
    assert np.isclose(weight_seconds(nbytes, bytes_per_weight, bandwidth, flops),
                      cpu.cpu_seconds(nbytes, n_params, n_tokens=1), rtol=1e-9)
