"""What a row costs beyond its bytes (the probe times two widths; the calibration prices rows), the rows a
step reads (placement.step_reads.modeled_rows), and the probe's bandwidth samples under its shares."""
from __future__ import annotations

import numpy as np
import pytest

from online.kind_probe import row_cost
from placement.fused_calibration import FusedCalibration, FusedTerms, KindRate
from placement.step_reads import LayerFractions, StepUnit, modeled_reads, modeled_rows


def _cal(rates) -> FusedCalibration:
    return FusedCalibration(threads=2, read_bandwidth_bytes_per_s=10e9, terms=(FusedTerms("int4", 0.0, 0.0, 1.0),),
                            rates=rates)


@pytest.mark.parametrize("rate, per_row", [(27.5e9, 3.1e-9), (12e9, 40e-9), (30e9, 0.0)])
def test_row_cost_recovers_the_per_row_time_of_two_widths(rate, per_row):
    """Per-row seconds = bytes / rate + per_row at two row lengths: row_cost gives per_row back."""
    wide, narrow = 2052, 516
    got = row_cost((wide, wide / rate + per_row), (narrow, narrow / rate + per_row))
    assert got == pytest.approx(per_row, abs=1e-15)


def test_row_cost_keeps_noise_in_bounds():
    wide = (2052, 77.7e-9)
    assert row_cost(wide, (516, 1e-9)) == 0.0  # narrow rows faster per byte than wide ones: no row cost
    assert row_cost(wide, (516, 90e-9)) == pytest.approx(0.9 * 77.7e-9)  # slower per row than wide: capped
    assert row_cost(wide, (2052, 70e-9)) == 0.0  # not two widths
    assert row_cost((0, 0.0), (0, 0.0)) == 0.0


def test_a_row_cost_prices_narrow_rows_slower_and_wide_rows_faster():
    """bytes / (share x bandwidth) at the probe's row length; in rows of b bytes: bytes / rate_inf + rows x row_s,
    the same line through the probe's point (rate_inf from the probe's share and row cost)."""
    share, bw, row_s, probe_row = 0.8, 10e9, 5e-9, 1024.0
    kr = KindRate("q4_0", "dense", share, row_s=row_s, row_bytes=probe_row)
    per_byte_inf = 1 / (share * bw) - row_s / probe_row  # the probe's per-row time, less its row cost, per byte
    nbytes = 1e6
    for row_bytes in (96.0, 512.0, 1024.0, 4096.0):
        rows = nbytes / row_bytes
        assert kr.pass_seconds(nbytes, bw, rows) == pytest.approx(nbytes * per_byte_inf + rows * row_s)
    assert kr.pass_seconds(nbytes, bw, nbytes / probe_row) == pytest.approx(nbytes / (share * bw))
    assert kr.pass_seconds(nbytes, bw) == pytest.approx(nbytes / (share * bw))  # rows not known: the probe's length
    plain = KindRate("q4_0", "dense", share)  # a rate from before the row term: one rate whatever the width
    assert plain.pass_seconds(nbytes, bw, nbytes / 96) == pytest.approx(nbytes / (share * bw))


def test_reads_seconds_adds_the_row_term_per_access_and_interpolates_it():
    cal = _cal((KindRate("f16", "axpy", 0.5, fraction=0.1, row_s=4e-9, row_bytes=4096),
                KindRate("f16", "axpy", 1.0, fraction=1.0, row_s=2e-9, row_bytes=4096),
                KindRate("int8", "dense", 0.9, row_s=3e-9, row_bytes=2052)))
    reads = {("f16", "axpy"): 2e6, ("int8", "dense"): 1e6}
    shares = {("f16", "axpy"): 0.55}
    rows = {("f16", "axpy"): 2e6 / 2048, ("int8", "dense"): 1e6 / 100}
    w = (0.55 - 0.1) / 0.9
    share, row_s = 0.5 + w * 0.5, 4e-9 + w * (2e-9 - 4e-9)  # both interpolated between the timed fractions
    want = (2e6 / (share * 10e9) + row_s * (rows[("f16", "axpy")] - 2e6 / 4096)
            + 1e6 / (0.9 * 10e9) + 3e-9 * (rows[("int8", "dense")] - 1e6 / 2052))
    assert cal.reads_seconds(0, reads, fixed=False, fractions=shares, rows=rows) == pytest.approx(want)
    base = cal.reads_seconds(0, reads, fixed=False, fractions=shares)
    assert base == pytest.approx(2e6 / (share * 10e9) + 1e6 / (0.9 * 10e9))
    assert cal.reads_seconds(0, reads, fixed=False, fractions=shares, rows=rows) > base  # narrower rows than probed


def test_modeled_rows_count_each_units_rows_at_its_share():
    units = [StepUnit("qkv", 0, "q8_0", 1000, rows=40), StepUnit("gate", 0, "q4_0", 400, rows=64),
             StepUnit("up", 0, "q4_0", 400, rows=64), StepUnit("down_t", 0, "f16", 800, rows=64),
             StepUnit("pred", 0, "int8", 50, rows=10), StepUnit("head", -1, "q8_0", 5000, rows=200),
             StepUnit("embed_row", -1, "f32", 16, rows=1)]
    predicted = [LayerFractions(gate=0.5, up=0.25, down=0.25, predicted=True)]
    rows = modeled_rows(units, predicted, relu=True)
    # brute force: each unit's access and share from modeled_reads of the unit alone, its rows at that share
    want: dict = {}
    for u in units:
        for key, nbytes in modeled_reads([u], predicted, relu=True).items():
            want[key] = want.get(key, 0.0) + u.rows * nbytes / u.packed_bytes
    assert rows == pytest.approx(want)
    assert rows[("q4_0", "gather")] == pytest.approx(64 * 0.5 + 64 * 0.25)
    assert rows[("q8_0", "dense")] == 240 and rows[("f16", "axpy")] == 16 and rows[("int8", "dense")] == 10
    unknown = [*units, StepUnit("o", 0, "q8_0", 100)]  # a unit of unknown rows: its format and access priced per byte
    assert ("q8_0", "dense") not in modeled_rows(unknown, predicted, relu=True)
    assert modeled_rows(unknown, predicted, relu=True)[("f16", "axpy")] == 16


def test_the_probe_times_two_widths_and_keeps_the_wide_rows_length(monkeypatch):
    from online import kind_probe

    monkeypatch.setattr(kind_probe, "PROBE_BYTES", 256 * 1024)
    monkeypatch.setattr(kind_probe, "REPEATS", 2)
    seen = []  # (wide, narrow) (bytes per row, seconds per row) pairs row_cost was given
    real_row_cost = kind_probe.row_cost
    monkeypatch.setattr(kind_probe, "row_cost",
                        lambda wide, narrow: seen.append((wide, narrow)) or real_row_cost(wide, narrow))
    kind_probe.cached_weight.cache_clear()
    try:
        rates = kind_probe.measure_kind_rates(2, 10e9, (("Q4_0", "dense"), ("int8", "dense"), ("fp16", "axpy")))
    finally:
        kind_probe.cached_weight.cache_clear()
    row = {"q4_0": kind_probe.COLS // 32 * 18, "int8": kind_probe.COLS + 4, "f16": 2 * kind_probe.COLS}
    cols = kind_probe.NARROW_COLS
    narrow = {"q4_0": cols // 32 * 18, "int8": cols + 4, "f16": 2 * cols}
    assert [(w[0], n[0]) for w, n in seen] == [(row[r.kind], narrow[r.kind]) for r in rates]  # two widths timed each
    for r in rates:
        rows = r.bytes / row[r.kind]
        assert rows == int(rows) > 0
        assert 0 <= r.row_s <= 0.9 * r.seconds / rows
        assert r.row_bytes == (row[r.kind] if r.row_s > 0 else 0.0)
    assert np.isfinite([r.share for r in rates]).all()


def test_a_fraction_whose_pass_found_no_row_cost_interpolates_from_zero():
    cal = _cal((KindRate("q4_0", "gather", 0.4, fraction=0.1, row_s=20e-9, row_bytes=1152),
                KindRate("q4_0", "gather", 0.8, fraction=1.0)))  # no row cost found at 100%
    mid = cal.rate("q4_0", "gather", 0.55)
    assert mid.share == pytest.approx(0.6) and mid.row_s == pytest.approx(10e-9) and mid.row_bytes == 1152
    assert cal.rate("q4_0", "gather", 1.0).row_s == 0.0


def test_the_probe_divides_every_share_by_the_median_of_its_bandwidth_samples(monkeypatch):
    """A sample before each format and access's passes and one after the last; every share over their median
    (not over the first sample alone)."""
    from online import kind_probe

    monkeypatch.setattr(kind_probe, "PROBE_BYTES", 256 * 1024)
    monkeypatch.setattr(kind_probe, "REPEATS", 2)
    script = iter([12e9, 30e9, 18e9, 24e9, 99e9])
    calls = []

    def sample() -> float:
        calls.append(next(script))
        return calls[-1]

    kind_probe.cached_weight.cache_clear()
    try:
        plan = (("Q4_0", "dense"), ("Q4_0", "gather"), ("int8", "dense"))
        rates, samples = kind_probe.measure_kind_rates_sampled(2, sample, plan)
    finally:
        kind_probe.cached_weight.cache_clear()
    assert samples == calls == [12e9, 30e9, 18e9, 24e9]  # three groups, then one after
    assert len(rates) == 1 + len(kind_probe.SPARSE_SHARES) + 1
    for r in rates:
        assert r.share == pytest.approx(r.bytes / r.seconds / 21e9)  # median of the four
