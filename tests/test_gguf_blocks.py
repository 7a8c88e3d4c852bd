"""GGUF blocks read in place by the C kernels (native/blocks.h): Q4_0 / Q4_1 / Q8_0 with their f16
scales and Q4_K super-blocks keep GGUF's bytes, every weight equals gguf's decode, the row kernels
equal the stated integer arithmetic (helpers_fused.matvec) and the float32-scale formats bit for bit,
multi-token rows equal single-token rows, and the fused step on f16-scaled weights (int4 rows, Q8 down
rows) equals the torch statement of its arithmetic."""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from helpers_fused import matvec
from online.kernels import native
from online.kernels.cpu_kernels import dequantize_into, kernel_weight
from online.kernels.native.structs import describe
from online.kernels.quantize import KIND_I4X8, BlockInt8Weight, Int4Weight, quantize
from online.kernels.superblocks import Q4KWeight
from online.kernels.quantize import weight_from_gguf
from test_kquants import random_blocks

Q = gguf.GGMLQuantizationType
ROWS, COLS = 11, 512  # 11: the four-row kernels and a tail of 3; 512: two Q4_K super-blocks
BYTES_PER_WEIGHT = {"Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q8_0": 34 / 32, "Q4_K": 144 / 256}


def _raw(qtype: str, seed: int = 0, cols: int = COLS) -> np.ndarray:
    """Random GGUF bytes [ROWS, row_bytes] with row magnitudes from 1e-4 to 3e3 (extreme f16 scales)."""
    rng = np.random.default_rng(seed)
    if qtype == "Q4_K":
        scales = np.array([6.1e-5, 3e-5, 0.02, -0.5, 7.0, 1e3, 6e-8, 0.1], np.float32)  # normal, subnormal, large
        return random_blocks("Q4_K", ROWS, cols, rng, scales)
    mags = np.logspace(-4, 3.5, ROWS).astype(np.float32)[:, None]
    w = rng.standard_normal((ROWS, cols)).astype(np.float32) * mags
    w[2, :32] = 0.0  # an all-zero block: scale 0
    return gguf.quants.quantize(w, getattr(Q, qtype))


def _float_scale_twin(w):
    """The same weights in the float32-scale formats (the kernels before blocks.h)."""
    if isinstance(w, BlockInt8Weight):
        return BlockInt8Weight(q=w.q, scale=w.scale.astype(np.float32))
    scale, minimum = w.float_scales()
    return Int4Weight(packed=w.packed, scale=scale, minimum=minimum, group_size=32)


def _x(T: int, seed: int = 1, cols: int = COLS) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((T, cols)).astype(np.float32)
    x[:, 37] = 40.0 * (1 + np.arange(T))  # outlier blocks (the residual pass where ratio >= 0)
    return x


def _dot(lib, w, r0: int, n: int, x: np.ndarray, ratio: float) -> np.ndarray:
    d, out = describe(w), np.zeros(n, np.float32)
    lib.tdm_dot_rows(ctypes.byref(d.desc), r0, n, x.ctypes.data, ratio, out.ctypes.data)
    return out


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_blocks_keep_gguf_bytes_and_values(qtype):
    raw = _raw(qtype)
    w = weight_from_gguf(raw, qtype, (ROWS, COLS))
    assert type(w) is {"Q8_0": BlockInt8Weight, "Q4_K": Q4KWeight}.get(qtype, Int4Weight)
    assert w.nbytes == raw.nbytes == ROWS * COLS * BYTES_PER_WEIGHT[qtype]
    ref = gguf.quants.dequantize(raw, getattr(Q, qtype)).reshape(ROWS, COLS)
    assert np.array_equal(w.dequantize(), ref)
    out = np.zeros((ROWS, COLS), np.float32)
    assert np.array_equal(dequantize_into(kernel_weight(w), out), ref)  # the C expansion of the scales (blocks.h)


@pytest.mark.parametrize("qtype, cols", [("Q4_0", COLS), ("Q4_1", COLS), ("Q8_0", COLS), ("Q4_K", COLS),
                                         ("Q4_0", 608), ("Q4_1", 608), ("Q8_0", 608)])  # 19 blocks: a tail of 3
@pytest.mark.parametrize("ratio", [-1.0, 2.0])
def test_row_dots_equal_the_integer_arithmetic_and_the_float_scale_kernels(qtype, cols, ratio):
    lib = native.load_native().lib
    w = weight_from_gguf(_raw(qtype, 3, cols), qtype, (ROWS, cols))
    twin = _float_scale_twin(w)
    x = _x(1, cols=cols)[0]
    ref = matvec(w, torch.from_numpy(x), ratio).double().numpy()  # [ROWS]
    scale = np.abs(w.dequantize()).astype(np.float64) @ np.abs(x)  # [ROWS]: float32 rounding grows with it
    for r0, n in ((0, ROWS), (1, 8), (8, 3)):
        got = _dot(lib, w, r0, n, x, ratio)
        assert np.array_equal(got, _dot(lib, twin, r0, n, x, ratio)), (r0, n)
        assert (np.abs(got - ref[r0:r0 + n]) <= 1e-5 * scale[r0:r0 + n]).all(), (r0, n)
    rows = np.array([7, 2, 5, 0, 10, 4, 4, 1, 3], np.int32)  # gathered rows (predict.h): two blocks of four, a tail
    for m in (rows.size, 4):
        got = _dot_idx(lib, w, rows[:m], x, ratio)
        # Q8_0's float-scale twin has no gathered four-row kernel (one row at a time, another rounding); the
        # f16-scale rows take every row, a list's last one to three too, through the four-row kernel
        same = m if qtype == "Q8_0" else 0
        assert np.array_equal(got[same:], _dot_idx(lib, twin, rows[:m], x, ratio)[same:]), m
        # the gathered four-row kernel has the contiguous one's arithmetic
        assert np.array_equal(got[:4], _dot(lib, w, 0, ROWS, x, ratio)[rows[:4]]), m
        assert (np.abs(got - ref[rows[:m]]) <= 1e-5 * scale[rows[:m]]).all(), m


def _dot_idx(lib, w, rows: np.ndarray, x: np.ndarray, ratio: float) -> np.ndarray:
    d, out = describe(w), np.zeros(rows.size, np.float32)
    lib.tdm_dot_rows_idx(ctypes.byref(d.desc), rows.ctypes.data, rows.size, x.ctypes.data, ratio, out.ctypes.data)
    return out


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_multi_token_rows_equal_single_token_rows(qtype):
    lib = native.load_native().lib
    d = describe(weight_from_gguf(_raw(qtype, 5), qtype, (ROWS, COLS)))
    for T in (2, 3, 5):
        x = _x(T, 6)
        for r0, n in ((0, ROWS), (1, 8), (6, 5)):
            got = np.zeros((T, n), np.float32)
            lib.tdm_dot_rows_multi(ctypes.byref(d.desc), r0, n, T, x.ctypes.data, 2.0, got.ctypes.data)
            for i in range(T):
                want = np.zeros(n, np.float32)
                lib.tdm_dot_rows(ctypes.byref(d.desc), r0, n, x[i].ctypes.data, 2.0, want.ctypes.data)
                assert np.array_equal(got[i], want), (T, r0, n, i)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_multi_token_f16_scale_rows_odd_widths_and_token_counts(qtype):
    """blocks_multi.h: block counts below 8, not a multiple of 8 (576 columns: 18) and whole vectors;
    token counts odd, past the scale chunk (8) and past one pass (64): dot_rows per token, bit for bit."""
    lib = native.load_native().lib
    for cols in (96, 576, 768):
        d = describe(weight_from_gguf(_raw(qtype, 7, cols), qtype, (ROWS, cols)))
        for T in (7, 9, 66):
            x = _x(T, 8, cols)
            x[T // 2, 64:96] = 0.0  # a zero block (scale 0) in one token
            got = np.zeros((T, ROWS), np.float32)
            lib.tdm_dot_rows_multi(ctypes.byref(d.desc), 0, ROWS, T, x.ctypes.data, 2.0, got.ctypes.data)
            for i in range(T):
                want = np.zeros(ROWS, np.float32)
                lib.tdm_dot_rows(ctypes.byref(d.desc), 0, ROWS, x[i].ctypes.data, 2.0, want.ctypes.data)
                assert np.array_equal(got[i], want), (cols, T, i)


def test_quantizing_floats_stores_f16_scales_where_they_fit():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    assert quantize(w, "int4").scale.dtype == np.float16 and quantize(w, "int8b").scale.dtype == np.float16
    assert quantize(w, "int4", 64).scale.dtype == np.float32  # groups of 64: no GGUF twin, float32
    tiny = w * 1e-7  # scales below float16's normal range keep float32 (no subnormal precision loss)
    assert quantize(tiny, "int4").scale.dtype == np.float32 and quantize(tiny, "int8b").scale.dtype == np.float32
    for fmt in ("int4", "int8b"):
        q = quantize(w, fmt)
        assert describe(q).desc.kind == {"int4": 5, "int8b": 6}[fmt]  # read in place (KIND_I4H / KIND_I8H)
        step = np.abs(w).max() / (7.0 if fmt == "int4" else 127.0)
        assert np.abs(q.dequantize() - w).max() <= step  # half a step of the group range, with slack


@pytest.mark.parametrize("kind", ["llama", "llama-relu"])
@pytest.mark.parametrize("down", ["int8b", "int4"])
def test_fused_step_on_f16_blocks_and_quantized_down_rows(tiny_model_dir, kind, down):
    """int4 rows with f16 scales (KIND_I4H) and Q8_0 / Q4_1 down rows (KIND_I8H / KIND_I4H), sparse: the fused
    step equals the torch statement of its arithmetic, stays within float noise of the module path (C
    kernels), and its multi-token form equals the single steps bit for bit."""
    from helpers_fused import reference_step
    from online.execution.fused_decode import FusedDecodeStep
    from tandem.core.generate import decode_one_token
    from tandem.core.kv_cache import KVCache
    from test_fused_decode import PROMPT, packed

    folder, _ = tiny_model_dir(kind)
    model, executor = packed(folder, "int4", thresholds=[0.0 if kind == "llama-relu" else 0.02] * 2,
                             down_format=down)
    split = executor.splits[0].cpu
    assert split.down_t.scale.dtype == np.float16 and split.up.scale.dtype == np.float16
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    # down rows in place; gate and up interleaved eight rows at a time where read by whole row ranges
    # (blocks_x8.h), up in place where the ReLU gate cut gathers its rows
    layer = step._layers[0]
    assert layer.down_t.kind == {"int8b": 6, "int4": 5}[down] and layer.gate.kind == KIND_I4X8
    assert layer.up.kind == (5 if kind == "llama-relu" else KIND_I4X8)
    cache, ref_cache, module_cache = (KVCache(model.cfg, 32) for _ in range(3))
    for pos, tok in enumerate(PROMPT):
        got = step(tok, pos, cache)
        ref, _ = reference_step(model, executor, ref_cache, tok, pos, residual_ratio=0.0)
        torch.testing.assert_close(got, ref.float(), rtol=1e-3, atol=1e-3)
        module = decode_one_token(model, executor, module_cache, tok, pos)
        torch.testing.assert_close(got, module, rtol=2e-2, atol=2e-2)
    single, multi = KVCache(model.cfg, 32), KVCache(model.cfg, 32)
    want = torch.stack([step(t, pos, single) for pos, t in enumerate(PROMPT)])
    assert torch.equal(step.step_many(PROMPT, 0, multi), want)


def test_concat_rows_keeps_blocks_and_refuses_mixed_scale_types():
    from online.kernels.quantize import concat_rows
    from tandem.core.errors import TandemError

    for qtype in ("Q4_0", "Q4_K", "Q8_0"):
        a, b = (weight_from_gguf(_raw(qtype, s), qtype, (ROWS, COLS)) for s in (7, 8))
        both = concat_rows([a, b])
        assert type(both) is type(a) and np.array_equal(both.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    q40 = weight_from_gguf(_raw("Q4_0", 7), "Q4_0", (ROWS, COLS))
    with pytest.raises(TandemError, match="scale type"):
        concat_rows([q40, _float_scale_twin(q40)])  # f16 scale without minimum + float32 scale and minimum
