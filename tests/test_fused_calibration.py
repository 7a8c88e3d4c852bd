"""The fused-step cost terms: the fit recovers known terms, files round-trip, bad files are refused."""
from __future__ import annotations

import json

import pytest

from placement.fused_calibration import FusedCalibration, fit_terms, load_calibration, save_calibration
from tandem.core.errors import TandemError


def test_fit_recovers_known_terms():
    bandwidth, call_s, layer_s, share = 30e9, 40e-6, 3e-6, 0.7
    samples = [(layers, read, call_s + layers * layer_s + read / (share * bandwidth))
               for layers, read in ((2, 2e6), (10, 11e6), (2, 80e6), (16, 300e6))]
    t = fit_terms("int4", samples, bandwidth)
    assert t.call_s == pytest.approx(call_s, rel=1e-6)
    assert t.layer_s == pytest.approx(layer_s, rel=1e-6)
    assert t.bandwidth_share == pytest.approx(share, rel=1e-6)
    cal = FusedCalibration(threads=2, read_bandwidth_bytes_per_s=bandwidth, terms=(t,))
    assert cal.step_seconds("int4", 16, 300e6) == pytest.approx(samples[-1][2], rel=1e-6)
    with pytest.raises(TandemError, match="int8"):
        cal.step_seconds("int8", 16, 300e6)


def test_calibration_round_trip_and_bad_files(tmp_path):
    t = fit_terms("int8", [(2, 1e6, 1e-4), (10, 5e6, 5e-4), (2, 8e7, 3e-3)], 30e9)
    cal = FusedCalibration(threads=2, read_bandwidth_bytes_per_s=30e9, terms=(t,), description="test")
    path = save_calibration(cal, tmp_path / "cal.json")
    assert load_calibration(path) == cal
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(TandemError, match="not a fused-step calibration"):
        load_calibration(tmp_path / "bad.json")
    with pytest.raises(TandemError, match="cannot read"):
        load_calibration(tmp_path / "missing.json")
