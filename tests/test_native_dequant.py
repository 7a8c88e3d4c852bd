"""The C dequantizer (prefill's weights, no JIT) against each format's numpy dequantize, and the C float GEMV."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from online.kernels.ffn import QuantizedLinear
from online.kernels.native import NativeUnavailable, load_native
from online.kernels.cpu_kernels import dequantize_into, gemv_rows, kernel_weight


@pytest.fixture(scope="module", autouse=True)
def _needs_native():
    try:
        load_native()
    except NativeUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("fmt,group_size", [("fp32", 32), ("fp16", 32), ("int8", 32), ("int8b", 32),
                                            ("int4", 32), ("int4", 64)])
def test_native_dequantize_matches_numpy(fmt, group_size):
    w = torch.from_numpy(np.random.default_rng(1).standard_normal((72, 256)).astype(np.float32))
    lin = QuantizedLinear.from_float(w, fmt=fmt, group_size=group_size)
    ours = dequantize_into(kernel_weight(lin.weight), np.empty(lin.weight.shape, np.float32))
    reference = lin.weight.dequantize()  # numpy: d * q + m rounded twice; C may fuse (1 ulp)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=np.abs(reference).max() * 2.0 ** -22)


def test_quantized_linear_prefill_uses_the_c_dequantizer():
    w = torch.from_numpy(np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32))
    lin = QuantizedLinear.from_float(w, fmt="int4")
    x = torch.randn(40, 128)  # more tokens than the row kernels take
    y = lin.forward(x)
    assert lin._native() is not None
    torch.testing.assert_close(y, x @ torch.from_numpy(lin.weight.dequantize()).T, rtol=1e-5, atol=1e-4)


def test_wrong_output_buffer_is_a_clear_error():
    lin = QuantizedLinear.from_float(torch.randn(32, 64), fmt="int8")
    with pytest.raises(Exception, match="float32 C-contiguous"):
        dequantize_into(kernel_weight(lin.weight), np.empty((32, 63), np.float32))


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8", "int8b", "int4"])
@pytest.mark.parametrize("n_tokens", [1, 3])
def test_native_float_gemv_matches_float_matmul(fmt, n_tokens):
    rng = np.random.default_rng(3)
    lin = QuantizedLinear.from_float(torch.from_numpy(rng.standard_normal((80, 192)).astype(np.float32)), fmt=fmt)
    x = rng.standard_normal((n_tokens, 192)).astype(np.float32)
    y = gemv_rows(kernel_weight(lin.weight), None, x, np.empty((n_tokens, 80), np.float32), 2)
    reference = x.astype(np.float64) @ lin.weight.dequantize().astype(np.float64).T  # [T, 80]
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-4)
    if n_tokens <= lin._max_tokens:  # few-token products take the C path
        assert np.array_equal(lin.forward_numpy(x), y)
