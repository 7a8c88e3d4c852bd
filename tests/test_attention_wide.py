"""Attention on 512-bit vectors (attention_wide.h: key pairs per vector, sixteen value columns, eight exponentials
a vector) against the 8-wide build of the same sources: the same bits, for float16 and float32 caches, any head
grouping (a pass holds 4 heads there, 2 here; up to 16 heads a KV group), head sizes with columns past the last
whole vector (16k + 8: an 8-wide pass there; not a multiple of 8: scalar columns in both), one part and several,
and one thread or two. Both are checked against float64 numpy too, so a bug shared by both builds
(attention_values.h is common to them) fails as well. On a CPU without AVX-512 the default build is the 8-wide
one and this module is skipped."""
from __future__ import annotations

import numpy as np
import pytest

from online.kernels import native
from test_attention_parts import SEGMENT_POSITIONS, _attend  # _attend: the step's attention units on n threads

pytestmark = pytest.mark.skipif(not native.load_native().has_wide_attention,
                                reason="this CPU has no AVX-512: one attention build only")


@pytest.fixture(scope="module")
def libs():
    narrow = native.load_native(("-DTDM_NO_WIDE_ATTENTION",))
    assert narrow.has_avx2 and not narrow.has_wide_attention
    return native.load_native().lib, narrow.lib


@pytest.mark.parametrize("rows", [1, 7, 203, SEGMENT_POSITIONS + 70])
@pytest.mark.parametrize("hd, rep", [(64, 3), (72, 5), (80, 1), (48, 6), (8, 2), (40, 16), (12, 9)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_wide_attention_equals_the_narrow_build(libs, rows, hd, rep, dtype):
    rng = np.random.default_rng(rows * hd + rep)
    n_kv = 2
    k = (rng.standard_normal((n_kv, rows, hd)) * 1.5).astype(dtype)  # [KV, rows, hd]
    v = rng.standard_normal((n_kv, rows, hd)).astype(dtype)  # [KV, rows, hd]
    q = rng.standard_normal((n_kv * rep, hd)).astype(np.float32)  # [H, hd]
    wide, narrow = (_attend(lib, k, v, q, rep, threads=2 if rows > 100 else 1) for lib in libs)
    assert np.array_equal(wide, narrow)
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for h in range(n_kv * rep):
        s = 0.125 * (k64[h // rep] @ q[h].astype(np.float64))  # [rows]
        p = np.exp(s - s.max())
        np.testing.assert_allclose(wide[h], (p / p.sum()) @ v64[h // rep], rtol=2e-5, atol=2e-6)
