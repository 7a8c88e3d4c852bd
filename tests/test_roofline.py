"""One roofline for the planner and the expert-miss rule (tandem/core/roofline.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from online.experts.cost import MissCostModel
from placement.cost_model import weight_seconds
from placement.hardware import load_hardware
from tandem.core.roofline import roofline_seconds


def test_roofline_is_the_larger_of_memory_and_compute_time():
    assert roofline_seconds(1e9, 1e9, 1e11, 1e12) == pytest.approx(1e-2)  # memory-bound
    assert roofline_seconds(1e6, 1e12, 1e11, 1e12) == pytest.approx(1.0)  # compute-bound
    got = roofline_seconds(np.array([1e9, 1e6]), np.array([1e9, 1e12]), 1e11, 1e12)
    np.testing.assert_allclose(got, [1e-2, 1.0])
    assert math.isinf(roofline_seconds(5.0, 5.0, 0.0, 1e12))
    assert np.isinf(roofline_seconds(np.ones(3), np.ones(3), 1e11, 0.0)).all()


def test_planner_and_expert_miss_rule_price_the_same_expert_alike():
    hw = load_hardware("rtx4090")
    n_params, bytes_per_weight, tokens = 176_160_768, 0.5625, 1
    nbytes = int(n_params * bytes_per_weight)
    by_hand = max(nbytes / hw.cpu_bandwidth_bytes_per_s, 2 * n_params * tokens / hw.cpu_matmul_flops)
    planner = weight_seconds(nbytes, nbytes / n_params, hw.cpu_bandwidth_bytes_per_s, hw.cpu_matmul_flops)
    runtime = MissCostModel.from_hardware(hw).cpu_seconds(nbytes, n_params, tokens)
    assert planner == pytest.approx(by_hand) and runtime == pytest.approx(by_hand)
