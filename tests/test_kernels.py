"""CPU kernels (online/kernels): every kernel against a float64 reference built from the dequantized
weights, GGUF imports against gguf's own decoder, quantization error against the float weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from online.kernels import cpu_kernels as K
from online.kernels.ffn import KERNEL_MAX_TOKENS, QuantizedFFN, QuantizedLinear
from online.kernels.quantize import (BlockInt8Weight, Fp32Weight, Int4Weight, Int8Weight, concat_rows, int4_from_q4_0,
                                     int4_from_q4_1, int8_from_q8_0, quantize, quantize_int4, quantize_int8,
                                     weight_from_gguf)
from tandem.core.errors import TandemError

RNG = np.random.default_rng(1234)
TH = K.clamp_threads(2)  # 1 on a single-core runner
T_KERNEL = 2  # tokens on the C row kernels (int8 / int4; fp32 goes to torch from T = 2)
T_TORCH = KERNEL_MAX_TOKENS + 2  # tokens on the dequantize + matmul path for every format


@pytest.fixture
def native_kernels():
    """The tests that call the C kernels directly (QuantizedLinear / QuantizedFFN fall back to torch without them)."""
    if not K.native_available():
        pytest.skip("the C kernels cannot be built here")


def _w(rows: int, cols: int) -> np.ndarray:
    return RNG.standard_normal((rows, cols)).astype(np.float32)


def _weights(rows: int, cols: int) -> dict[str, object]:
    """One weight per kernel format (int4 needs cols % 64 == 0 here)."""
    w = _w(rows, cols)
    q8d = (RNG.random((rows, cols // 32)) * 0.02 + 0.001).astype(np.float16)
    q8q = RNG.integers(-127, 128, (rows, cols), dtype=np.int8)
    return {"fp32": Fp32Weight(w), "fp16": quantize(w, "fp16"), "int8": quantize_int8(w), "int8-block": int8_from_q8_0(q8d, q8q),
            "int4-g32": quantize_int4(w, 32), "int4-g64": quantize_int4(w, 64)}


def _close(got: np.ndarray, ref: np.ndarray, rtol: float = 2e-5) -> None:
    scale = max(float(np.abs(ref).max()), 1e-6)
    err = float(np.abs(np.asarray(got, dtype=np.float64) - ref).max()) / scale
    assert err < rtol, f"relative error {err:.2e}"


# --- formats ------------------------------------------------------------------------------

def test_int8_per_row_quantization_error_is_half_a_step():
    w = _w(33, 45)
    q = quantize_int8(w)
    assert isinstance(q, Int8Weight) and q.q.dtype == np.int8 and q.nbytes == 33 * 45 + 33 * 4
    step = np.abs(w).max(axis=1, keepdims=True) / 127.0
    assert (np.abs(q.dequantize() - w) <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64])
def test_int4_group_quantization_error_is_half_a_step(group):
    w = _w(7, 128)
    q = quantize_int4(w, group)
    g = w.reshape(7, -1, group)
    step = (g.max(-1) - g.min(-1)) / 15.0  # [7, groups]
    err = np.abs(q.dequantize() - w).reshape(7, -1, group)
    assert (err <= step[..., None] / 2 + 1e-5).all()
    assert q.nbytes == 7 * 64 + 2 * 7 * (128 // group) * (2 if group == 32 else 4)  # f16 scales for groups of 32
    assert q.codes().max() <= 15


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_gguf_blocks_convert_exactly(qtype, native_kernels):
    w = _w(6, 96)
    raw = gq.quantize(w, qtype)  # uint8 [6, row bytes]
    ref = gq.dequantize(raw, qtype).astype(np.float64)  # gguf's own decoder
    packed = weight_from_gguf(raw, qtype.name, (6, 96))
    assert isinstance(packed, BlockInt8Weight if qtype == QT.Q8_0 else Int4Weight)
    np.testing.assert_array_equal(packed.dequantize(), ref)
    x = RNG.standard_normal((1, 96)).astype(np.float32)
    y = np.empty((1, 6), np.float32)
    K.gemv_rows(K.kernel_weight(packed), np.arange(6), x, y, TH)
    _close(y, x.astype(np.float64) @ ref.T)


def test_gguf_field_constructors_match_formulas():
    d = (RNG.random((3, 2)) * 0.1).astype(np.float16)
    m = (RNG.standard_normal((3, 2)) * 0.1).astype(np.float16)
    q = RNG.integers(0, 16, (3, 64)).astype(np.uint8)
    qq = RNG.integers(-127, 128, (3, 64), dtype=np.int8)
    rep = lambda a: np.repeat(a.astype(np.float32), 32, axis=1)  # noqa: E731
    np.testing.assert_allclose(int4_from_q4_1(d, m, q).dequantize(), rep(d) * q + rep(m), rtol=0, atol=1e-7)
    np.testing.assert_array_equal(int4_from_q4_0(d, q).dequantize(), rep(d) * (q.astype(np.float32) - 8))
    np.testing.assert_array_equal(int8_from_q8_0(d, qq).dequantize(), rep(d) * qq)


def test_bad_inputs_raise_tandem_errors():
    with pytest.raises(TandemError):
        quantize_int4(_w(4, 40), 32)  # 40 not a multiple of 32
    with pytest.raises(TandemError):
        quantize_int4(_w(4, 64), 16)
    with pytest.raises(TandemError):
        quantize(_w(4, 64), "int3")
    with pytest.raises(TandemError):
        quantize_int8(np.full((2, 2), np.nan, np.float32))
    with pytest.raises(TandemError):
        int4_from_q4_1(np.ones((2, 1)), np.ones((2, 1)), np.full((2, 32), 16, np.uint8))
    lin = QuantizedLinear.from_float(torch.randn(8, 64))
    with pytest.raises(TandemError):
        lin.forward(torch.randn(2, 63))
    with pytest.raises(TandemError):
        lin.forward(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(TandemError):
        lin.forward_rows(torch.randn(1, 64), torch.tensor([8]))
    with pytest.raises(TandemError):
        QuantizedFFN.from_float(up=torch.randn(16, 64), down=torch.randn(64, 16), act="swish")


# --- GEMV kernels ---------------------------------------------------------------------------

@pytest.mark.parametrize("threads", sorted({1, TH}))
def test_gemv_every_format_matches_dequantized_reference(threads, native_kernels):
    rows, cols = 37, 128  # 37 rows: not a multiple of the thread count
    x = RNG.standard_normal((T_KERNEL, cols)).astype(np.float32)
    for name, w in _weights(rows, cols).items():
        ref = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
        y = np.empty((T_KERNEL, rows), np.float32)
        K.gemv_rows(K.kernel_weight(w), np.arange(rows), x, y, threads)
        _close(y, ref)
        sel = np.array([36, 0, 5, 5, 17])
        ys = np.empty((T_KERNEL, sel.size), np.float32)
        K.gemv_rows(K.kernel_weight(w), sel, x, ys, threads)
        _close(ys, ref[:, sel])


def test_odd_widths_for_fp32_and_int8(native_kernels):
    w = _w(13, 45)  # 45 columns: vector loops need their scalar tails
    x = RNG.standard_normal((1, 45)).astype(np.float32)
    for q in (Fp32Weight(w), quantize_int8(w)):
        y = np.empty((1, 13), np.float32)
        K.gemv_rows(K.kernel_weight(q), np.arange(13), x, y, TH)
        _close(y, x.astype(np.float64) @ q.dequantize().astype(np.float64).T)
        out = np.empty((13, 45), np.float32)
        K.dequantize_into(K.kernel_weight(q), out)
        np.testing.assert_allclose(out, q.dequantize(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt,tol", [("fp32", 1e-6), ("int8", 2e-2), ("int4", 2e-1)])
def test_quantized_linear_tokens_and_error_bound(fmt, tol):
    w, b = torch.randn(40, 128), torch.randn(40)
    lin = QuantizedLinear.from_float(w, fmt, bias=b)
    deq = lin.dequantize().double()
    for T in (1, T_KERNEL, T_TORCH):
        x = torch.randn(T, 128)
        y = lin.forward(x)
        assert y.shape == (T, 40) and y.dtype == torch.float32
        _close(y.numpy(), (x.double() @ deq.T + b.double()).numpy())  # exact up to rounding
        exact = x.double() @ w.double().T + b.double()
        assert float((y.double() - exact).abs().max() / exact.abs().max()) < tol  # quantization error
    x1 = torch.randn(128)
    assert lin.forward(x1).shape == (40,)
    idx = torch.tensor([39, 3, 3])
    _close(lin.forward_rows(x1[None], idx).numpy(), (x1.double() @ deq.T + b.double())[idx].numpy()[None])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_concat_rows_is_one_projection(fmt):
    ws = [torch.randn(r, 64) for r in (8, 3, 5)]
    parts = [QuantizedLinear.from_float(w, fmt) for w in ws]
    fused = QuantizedLinear(concat_rows([p.weight for p in parts]))
    x = torch.randn(1, 64)
    np.testing.assert_allclose(fused.forward(x).numpy(), torch.cat([p.forward(x) for p in parts], 1).numpy(),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(TandemError):
        concat_rows([parts[0].weight, quantize_int8(_w(4, 32))])


def test_embedding_rows_through_a_q8_0_output_layer():
    w = _w(50, 64)
    raw = gq.quantize(w, QT.Q8_0)

    class Raw:  # RawQuantTensor-like
        qtype, shape, data = "Q8_0", (50, 64), raw
    head = QuantizedLinear.from_gguf(Raw())
    ids = torch.tensor([4, 49, 4])
    np.testing.assert_array_equal(head.embed(ids).numpy(), gq.dequantize(raw, QT.Q8_0)[[4, 49, 4]])


# --- sparse down projection -----------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8", "int8-block", "int4-g32", "int4-g64"])
def test_sparse_down_matches_masked_reference(fmt, native_kernels):
    n_ff, d = 45, 128
    wt = _weights(n_ff, d)[fmt]  # transposed down projection: rows are neurons
    deq = wt.dequantize().astype(np.float64)
    h = RNG.standard_normal((2, n_ff)).astype(np.float32)
    y0 = np.empty((2, d), np.float32)
    assert K.down_sparse(K.kernel_weight(wt), h, 0.0, y0, TH) == h.size
    _close(y0, h.astype(np.float64) @ deq)  # threshold 0 == dense
    t = 0.7
    y = np.empty((2, d), np.float32)
    count = K.down_sparse(K.kernel_weight(wt), h, t, y, TH)
    keep = np.abs(h) > t
    assert count == keep.sum()
    _close(y, np.where(keep, h, 0).astype(np.float64) @ deq)


# --- fused FFN ------------------------------------------------------------------------------

def _act_ref(act: str, g: torch.Tensor, u: torch.Tensor, alpha: float) -> torch.Tensor:
    if act == "drelu":
        return F.relu(g) * F.relu(u)
    a = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
         "fatrelu": lambda v: torch.where(v > alpha, v, torch.zeros_like(v))}[act](g)
    return a * u


def _ffn_ref(ffn: QuantizedFFN, x: torch.Tensor, rows=None, threshold: float = -1.0) -> tuple[torch.Tensor, int]:
    """float64 reference from the dequantized weights; optional neuron subset and |h| threshold."""
    dq = lambda w: torch.from_numpy(w.dequantize()).double()  # noqa: E731
    x = x.double()
    u = x @ dq(ffn.up).T + torch.from_numpy(ffn.up_bias).double() if ffn.up_bias.size else x @ dq(ffn.up).T
    if ffn.gate is not None:
        g = x @ dq(ffn.gate).T
        if ffn.gate_bias.size:
            g = g + torch.from_numpy(ffn.gate_bias).double()
        h = _act_ref(ffn.act, g, u, ffn.act_threshold)
    else:
        h = _act_ref(ffn.act, u, torch.ones_like(u), ffn.act_threshold)
    mask = torch.zeros_like(h, dtype=torch.bool)
    mask[:, rows if rows is not None else slice(None)] = True
    mask &= h.abs() > threshold
    y = (h * mask) @ dq(ffn.down_t)
    if ffn.down_bias.size:
        y = y + torch.from_numpy(ffn.down_bias).double()
    return y, int(mask.sum())


def _ffn_weights(n_ff: int = 45, d: int = 128):
    return torch.randn(n_ff, d) * 0.2, torch.randn(d, n_ff) * 0.2, torch.randn(n_ff, d) * 0.2


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_ffn_dense_sparse_predicted_match_reference(fmt):
    up, down, gate = _ffn_weights()
    ffn = QuantizedFFN.from_float(up=up, down=down, gate=gate, fmt=fmt, act="silu")
    for T in (1, T_KERNEL, T_TORCH):
        x = torch.randn(T, 128)
        ref, _ = _ffn_ref(ffn, x)
        _close(ffn.forward_dense(x).numpy(), ref.numpy())
        y0, n0 = ffn.forward_sparse(x, 0.0)
        _close(y0.numpy(), ref.numpy())  # threshold 0 == dense
        assert n0 == T * 45
        t = 0.05
        y, n = ffn.forward_sparse(x, t)
        ref_t, n_ref = _ffn_ref(ffn, x, threshold=t)
        _close(y.numpy(), ref_t.numpy())
        assert n == n_ref and 0 < n < T * 45
        _close(ffn.forward_predicted(x, torch.arange(45)).numpy(), ref.numpy())  # all rows == dense
        sub = torch.tensor([44, 2, 30, 7])
        _close(ffn.forward_predicted(x, sub).numpy(), _ffn_ref(ffn, x, rows=sub)[0].numpy())
    assert ffn.forward_predicted(torch.randn(1, 128), torch.tensor([], dtype=torch.int64)).abs().max() == 0


@pytest.mark.parametrize("act", ["relu", "fatrelu", "drelu", "gelu", "gelu_tanh"])
def test_ffn_activations(act):
    up, down, gate = _ffn_weights()
    ffn = QuantizedFFN.from_float(up=up, down=down, gate=gate, fmt="int8", act=act, act_threshold=0.1)
    x = torch.randn(2, 128)
    _close(ffn.forward_dense(x).numpy(), _ffn_ref(ffn, x)[0].numpy())
    y, n = ffn.forward_sparse(x, 1e-3)  # not 0: float32 gelu/silu tails underflow to exact zeros
    ref, n_ref = _ffn_ref(ffn, x, threshold=1e-3)
    _close(y.numpy(), ref.numpy())
    assert n == n_ref


def test_plain_ffn_with_biases_on_both_paths():
    up, down, _ = _ffn_weights(37, 64)
    ffn = QuantizedFFN.from_float(up=up, down=down, fmt="int4", act="relu", up_bias=torch.randn(37),
                                  down_bias=torch.randn(64), threads=2)
    for T in (1, T_TORCH):
        x = torch.randn(T, 64)
        _close(ffn.forward_dense(x).numpy(), _ffn_ref(ffn, x)[0].numpy())


def test_quantized_ffn_error_against_float_is_bounded():
    up, down, gate = _ffn_weights(64, 128)
    x = torch.randn(1, 128)
    exact = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    for fmt, tol in (("fp32", 1e-5), ("int8", 3e-2), ("int4", 3e-1)):
        y = QuantizedFFN.from_float(up=up, down=down, gate=gate, fmt=fmt).forward_dense(x)
        assert float((y - exact).abs().max() / exact.abs().max()) < tol, fmt


def test_ffn_from_gguf_blocks():
    up, down, gate = (t.numpy() for t in _ffn_weights(64, 96))

    class Raw:
        def __init__(self, w):
            self.qtype, self.shape, self.data = "Q4_1", w.shape, gq.quantize(w, QT.Q4_1)
    ffn = QuantizedFFN.from_gguf(up=Raw(up), down=Raw(down), gate=Raw(gate), down_fmt="fp32")
    ref = lambda w: torch.from_numpy(gq.dequantize(Raw(w).data, QT.Q4_1)).double()  # noqa: E731
    x = torch.randn(1, 96)
    expect = (F.silu(x.double() @ ref(gate).T) * (x.double() @ ref(up).T)) @ ref(down).T
    _close(ffn.forward_dense(x).numpy(), expect.numpy())


@pytest.mark.parametrize("n", [1, 3, 4, 129, 1000])
def test_attention_softmax_exponentials_are_correctly_rounded(n, native_kernels):
    """Attention's softmax (attention.h softmax_exp, vectorized) against float64 numpy: e^(s - max) (the
    difference in float32) rounded once to float32, so every value is within one ulp of the correctly rounded one and almost all equal
    it; the sum in key order; the tail past a multiple of four (padded lanes) alike."""
    import ctypes
    from online.kernels.native import load_native
    softmax_exp = load_native().lib.tdm_softmax_exp  # a self-check entry: bound here, not by bind_signatures
    softmax_exp.argtypes, softmax_exp.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_double
    scores = (RNG.standard_normal(n) * 12.0).astype(np.float32)
    scores[::7] -= 95.0  # values down where e^x is subnormal or zero in float32
    got = scores.copy()
    total = softmax_exp(got.ctypes.data, n)
    shifted = scores - scores.max()  # [n] float32 subtraction, as the step (and expf before it) does
    exact = np.exp(shifted.astype(np.float64)).astype(np.float32)  # [n]
    ulps = np.abs(got.view(np.int32).astype(np.int64) - exact.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1 and (ulps > 0).mean() <= 0.01
    assert total == float(np.add.accumulate(got, dtype=np.float32)[-1])
