"""Q4_0 / Q4_1 / Q8_0 rows interleaved eight at a time (native/blocks_x8.h, structs.interleave): every row
equals the integer arithmetic of gguf's blocks (helpers_fused.matvec) within float32 noise, a row's
value does not depend on the path that computed it (eight-row vector kernel, the scalar edge rows,
gathered rows, any row range), the multi-token kernel equals the single-token one bit for bit, and
the fused step interleaves exactly the matrices it reads by whole row ranges."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from helpers_fused import matvec
from online.execution.fused_decode import dense_rows
from online.kernels import native
from online.kernels.native.structs import describe, interleave
from online.kernels.quantize import KIND_I4H, KIND_I4X8, KIND_I8X8, quantize, weight_from_gguf

Q = gguf.GGMLQuantizationType
ROWS = 21  # two whole groups of eight and a padded one


def _weight(qtype: str, cols: int, seed: int = 0):
    """Random Q4_0 / Q4_1 / Q8_0 rows with magnitudes 1e-4 .. 3e3 (subnormal and large f16 scales), one zero block."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((ROWS, cols)).astype(np.float32) * np.logspace(-4, 3.5, ROWS).astype(np.float32)[:, None]
    w[2, :32] = 0.0
    return weight_from_gguf(gguf.quants.quantize(w, getattr(Q, qtype)), qtype, (ROWS, cols))


def _x(T: int, cols: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((T, cols)).astype(np.float32)
    x[:, 37] = 40.0 * (1 + np.arange(T))  # outlier blocks: the residual pass where ratio >= 0
    return x


def _rows(lib, ref, r0: int, n: int, x: np.ndarray, ratio: float) -> np.ndarray:
    out = np.zeros(n, np.float32)
    lib.tdm_dot_rows(ctypes.byref(ref.desc), r0, n, x.ctypes.data, ratio, out.ctypes.data)
    return out


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("cols", [96, 512, 608])  # 3, 16 and 19 blocks of 32
@pytest.mark.parametrize("ratio", [-1.0, 2.0])
def test_interleaved_rows_equal_the_block_arithmetic_on_every_path(qtype, cols, ratio):
    lib = native.load_native().lib
    w = _weight(qtype, cols)
    ref = interleave(describe(w), lib)
    assert ref.desc.kind == (KIND_I8X8 if qtype == "Q8_0" else KIND_I4X8) and ref.desc.rows == ROWS
    x = _x(1, cols)[0]
    want = matvec(w, torch.from_numpy(x), ratio).double().numpy()  # [ROWS] gguf's integer arithmetic
    scale = np.abs(w.dequantize()).astype(np.float64) @ np.abs(x)  # float32 rounding grows with it
    full = _rows(lib, ref, 0, ROWS, x, ratio)
    assert (np.abs(full - want) <= 1e-5 * scale).all()
    for r0, n in ((1, 1), (3, 9), (8, 8), (5, 16), (16, 5)):  # scalar edge rows, whole groups, the padded group
        assert np.array_equal(_rows(lib, ref, r0, n, x, ratio), full[r0:r0 + n]), (r0, n)
    rows = np.array([7, 2, 20, 0, 10, 4, 4, 1, 3], np.int32)  # gathered (predict.h): row by row
    got = np.zeros(rows.size, np.float32)
    lib.tdm_dot_rows_idx(ctypes.byref(ref.desc), rows.ctypes.data, rows.size, x.ctypes.data, ratio, got.ctypes.data)
    assert np.array_equal(got, full[rows])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("ratio", [-1.0, 2.0])  # without / with the residual pass on outlier blocks
def test_interleaved_multi_token_rows_equal_single_token_rows(qtype, ratio):
    lib = native.load_native().lib
    for cols in (96, 576):
        ref = interleave(describe(_weight(qtype, cols, 5)), lib)
        for T in (2, 3, 4, 5, 7, 8, 9, 16, 66):  # four at a time, then two, then one; minimums eight at a time
            x = _x(T, cols, 6)
            x[T // 2, 64:96] = 0.0  # a zero block in one token
            for r0, n in ((0, ROWS), (3, 14), (8, 8)):
                got = np.zeros((T, n), np.float32)
                lib.tdm_dot_rows_multi(ctypes.byref(ref.desc), r0, n, T, x.ctypes.data, ratio, got.ctypes.data)
                for i in range(T):
                    assert np.array_equal(got[i], _rows(lib, ref, r0, n, x[i], ratio)), (cols, T, r0, n, i)


def test_interleave_keeps_what_it_cannot_repack():
    lib = native.load_native().lib
    q8 = describe(weight_from_gguf(gguf.quants.quantize(np.ones((8, 64), np.float32), Q.Q8_0), "Q8_0", (8, 64)))
    assert interleave(q8, lib).desc.kind == KIND_I8X8  # Q8_0: the int8 layout
    assert interleave(describe(quantize(np.ones((8, 64), np.float32), "int8")), lib).desc.kind != KIND_I8X8
    q40 = describe(weight_from_gguf(gguf.quants.quantize(np.ones((8, 64), np.float32), Q.Q4_0), "Q4_0", (8, 64)))
    assert q40.desc.kind == KIND_I4H
    for ref, per_row in ((q40, 36), (q8, 68), (describe(_weight("Q4_1", 64)), 40)):  # GGUF's bytes per row
        assert interleave(ref, lib).desc.row_bytes == per_row
    assert interleave(q40, SimpleNamespace()) is q40  # a library without the kernel
    assert interleave(describe(quantize(np.ones((8, 64), np.float32), "int4")), lib).desc.kind == KIND_I4X8


def test_fused_step_interleaves_only_whole_row_ranges():
    silu, relu = SimpleNamespace(mlp_gated=True, hidden_act="silu"), SimpleNamespace(mlp_gated=True, hidden_act="relu")
    refs = dict.fromkeys(("qkv", "o", "gate", "up", "down"))
    dense, predicted = SimpleNamespace(predictor=None, threshold=0.01), SimpleNamespace(predictor=object(), threshold=0.0)
    assert sorted(dense_rows(silu, dense, refs)) == ["down", "gate", "o", "qkv", "up"]
    assert sorted(dense_rows(relu, dense, refs)) == ["down", "gate", "o", "qkv"]  # up rows gathered by the gate cut
    # without a cut yet, a ReLU layer's up still stays in place: with_thresholds (the sparse drafter) can turn one on
    assert sorted(dense_rows(relu, SimpleNamespace(predictor=None, threshold=-1.0), refs)) == ["down", "gate", "o", "qkv"]
    assert sorted(dense_rows(silu, predicted, refs)) == ["down", "o", "qkv"]  # predicted rows gathered
    assert dense_rows(silu, None, dict.fromkeys(("q", "k", "v", "o"))) == ["q", "k", "v", "o"]  # a MoE layer
    plain = SimpleNamespace(mlp_gated=False, hidden_act="relu")  # OPT: no gate (its descriptor is up's)
    assert sorted(dense_rows(plain, dense, refs)) == ["down", "o", "qkv", "up"]


@pytest.mark.parametrize("n", [7, 8, 36, 576, 1000, 49152])
@pytest.mark.parametrize("nt", [1, 2, 3, 5, 16])
def test_row_ranges_split_on_whole_groups_of_eight(n, nt):
    """A matrix's rows split between threads on group boundaries (decode.c row_chunk: the probe's passes): the ranges
    tile [0, n) in order, every inner boundary is a multiple of eight (no scalar edge rows), and no thread
    gets more than one group above an even share."""
    fn = native.load_native().lib.tdm_row_chunk
    fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p], None
    out = np.zeros(2, np.int64)
    bounds = []
    for t in range(nt):
        fn(n, t, nt, out.ctypes.data)
        bounds.append((int(out[0]), int(out[1])))
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(lo <= hi and lo % 8 == 0 for lo, hi in bounds)
    assert all(hi - lo <= 8 * (-(-n // 8) // nt + 1) for lo, hi in bounds)
