"""The cache's speedup on reads a step repeats every token: the calibration's interpolation against numpy's,
which reads it divides, its file schema, best_of, the last-level cache size from sysfs, and the probe."""
from __future__ import annotations

import json

import numpy as np
import pytest

from placement.fused_calibration import (FusedCalibration, FusedTerms, KindRate, best_of, load_calibration,
                                         monotone_speedups, save_calibration)
from placement.probe import last_level_cache_bytes
from tandem.core.errors import TandemError

MB = 2**20
TABLE = ((8 * MB, 2.0), (64 * MB, 1.5), (256 * MB, 0.9))


def _cal(residency=TABLE) -> FusedCalibration:
    rates = (KindRate("q8_0", "dense", 0.5), KindRate("q8_0", "axpy", 0.25),
             KindRate("q8_0", "gather", 0.4, fraction=1.0), KindRate("f16", "attend", 0.3, fraction=1.0))
    return FusedCalibration(threads=2, read_bandwidth_bytes_per_s=10e9, terms=(FusedTerms("int4", 1e-4, 1e-5, 1.0),),
                            rates=rates, residency=residency)


@pytest.mark.parametrize("size", [1 * MB, 8 * MB, 20 * MB, 64 * MB, 100 * MB, 255 * MB, 4096 * MB])
def test_speedup_interpolates_in_log_bytes_and_never_slows(size):
    xs = np.log([b for b, _ in TABLE])
    want = max(1.0, float(np.interp(np.log(size), xs, [v for _, v in TABLE])))  # numpy clamps at the ends too
    assert _cal().residency_at(size) == pytest.approx(want)
    assert _cal(()).residency_at(size) == 1.0  # a calibration from before the term: no speedup


def test_speedups_are_made_non_increasing_as_isotonic_regression_does():
    from sklearn.isotonic import IsotonicRegression

    rng = np.random.default_rng(0)
    for _ in range(50):
        values = list(rng.uniform(0.8, 2.5, size=int(rng.integers(1, 9))))
        want = IsotonicRegression(increasing=False).fit_transform(np.arange(len(values)), values)
        assert monotone_speedups(values) == pytest.approx(list(want))
    noisy = _cal(((8 * MB, 2.2), (16 * MB, 0.9), (32 * MB, 1.5), (64 * MB, 1.8), (128 * MB, 1.0), (256 * MB, 1.1)))
    assert noisy.residency_at(32 * MB) == pytest.approx(1.4)  # the dip at 16 MB pooled with the rise after it
    assert noisy.residency_at(512 * MB) == pytest.approx(1.05)


def test_only_reads_repeated_every_token_are_divided():
    cal = _cal()
    reads = {("q8_0", "dense"): 3e6, ("f16", "attend"): 1e6, ("q8_0", "gather"): 2e6, ("q8_0", "axpy"): 1e6}
    fixed = 1e-4 + 2 * 1e-5
    rho = cal.residency_at(7e6)  # the step's bytes per token: 7 MB, below the smallest size -> 2.0
    assert rho == 2.0
    want = fixed + (3e6 / 5e9 + 1e6 / 3e9) / rho + 2e6 / 4e9 + 1e6 / 2.5e9
    assert cal.reads_seconds(2, reads) == pytest.approx(want)
    at_100 = cal.residency_at(100 * MB)
    want_100 = fixed + (3e6 / 5e9 + 1e6 / 3e9) / at_100 + 2e6 / 4e9 + 1e6 / 2.5e9
    assert cal.reads_seconds(2, reads, working_set_bytes=100 * MB) == pytest.approx(want_100)
    assert _cal(()).reads_seconds(2, reads) == pytest.approx(fixed + 3e6 / 5e9 + 1e6 / 3e9 + 2e6 / 4e9 + 1e6 / 2.5e9)


def test_residency_round_trips_old_files_load_and_bad_tables_are_refused(tmp_path):
    cal = _cal()
    path = save_calibration(cal, tmp_path / "cal.json")
    assert load_calibration(path) == cal
    data = json.loads(path.read_text())
    del data["residency"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_calibration(tmp_path / "old.json").residency_at(MB) == 1.0
    listed = _cal([[8 * MB, 2.0], [64 * MB, 1.5]])  # built from lists (as JSON gives them): kept as tuples
    assert listed.residency == ((8 * MB, 2.0), (64 * MB, 1.5)) and hash(listed)
    for bad in ([[64 * MB, 1.5], [8 * MB, 2.0]], [[8 * MB, 0.0]], [[8 * MB]], [[0, 1.2]], ["x"], [[8 * MB, "fast"]],
                [[1e400, 1.5]], [[2**70, 1.5], [2**80, 1.2]], [[8 * MB, 2.0], [8 * MB, 1.5]], "none", [[8 * MB, None]]):
        (tmp_path / "bad.json").write_text(json.dumps({**data, "residency": bad}))
        with pytest.raises(TandemError, match="invalid fused-step calibration"):
            load_calibration(tmp_path / "bad.json")


def test_best_of_keeps_the_median_speedup_per_size():
    cals = [_cal(((8 * MB, v), (64 * MB, w))) for v, w in ((2.0, 1.1), (1.2, 1.4), (1.6, 1.0))]
    assert best_of(cals).residency == ((8 * MB, 1.6), (64 * MB, 1.1))


def test_last_level_cache_size_from_sysfs(tmp_path):
    for name, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "307200K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    assert last_level_cache_bytes(root=tmp_path) == 307200 * 1024
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "size").write_text("garbage")  # unreadable entries are skipped
    assert last_level_cache_bytes(root=tmp_path) == 307200 * 1024
    assert last_level_cache_bytes(default=123, root=tmp_path / "none") == 123


def test_probe_measures_every_size_in_order(small_eviction):
    from online.residency_probe import ROW_ALIGN, ROW_BYTES, ResidencyProbe, measure_residency

    table = measure_residency(2, sizes=(2 * MB, MB // 2), pairs=2)
    assert [b for b, _ in table] == [MB // 2, 2 * MB]
    assert all(0.2 < v < 50 for _, v in table)  # a table the calibration accepts
    FusedCalibration(2, 10e9, (), residency=table)
    probe = ResidencyProbe(1, MB)
    assert probe.max_bytes == MB // ROW_BYTES // ROW_ALIGN * ROW_ALIGN * ROW_BYTES
    assert probe.pass_bytes(64 * MB) == probe.max_bytes  # past the matrix: the whole matrix
    assert probe.pass_bytes(1) == ROW_ALIGN * ROW_BYTES  # at least one whole interleave group
    assert all(t > 0 for t in probe.timed_pair(64 * MB))
    with pytest.raises(TandemError, match="working set"):
        probe.speedup(0)
    with pytest.raises(TandemError, match="pairs"):
        measure_residency(1, sizes=(MB,), pairs=0)
