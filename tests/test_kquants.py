"""k-quant / Q5 / IQ4_NL decoders against gguf-py's reference dequantizers (bit-exact)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from tandem.core.loading.kquants import KQUANT_LAYOUT, kquant_fields
from tandem.core.loading.quants import dequantize
from tandem.core.errors import TandemError

Q = gguf.GGMLQuantizationType
# byte offsets of the f16 scale fields inside each block
F16_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,)}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, scales: np.ndarray | None = None):
    """Random on-disk bytes [rows, row_bytes]; f16 fields set from ``scales`` (cycled) or N(0, 0.05)."""
    elems, nbytes = KQUANT_LAYOUT[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // elems, nbytes), dtype=np.uint8)
    for k, off in enumerate(F16_OFFSETS[qtype]):
        if scales is None:
            vals = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        else:
            vals = np.resize(scales, blocks.shape[0]).astype(np.float16)
            vals = np.roll(vals, k)
        blocks[:, off:off + 2] = vals.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(KQUANT_LAYOUT))
def test_decoders_bit_exact_random_blocks(qtype):
    rng = np.random.default_rng(7)
    for rows, cols in ((3, 256), (5, 768), (1, 2048)):
        raw = random_blocks(qtype, rows, cols, rng)
        ref = gguf.quants.dequantize(raw, Q[qtype]).reshape(rows, cols)
        got = dequantize(raw, qtype, (rows, cols))
        assert got.dtype == np.float32 and np.array_equal(got, ref)
    big = random_blocks(qtype, 4100, 512, rng)  # several decode chunks, odd row count at the tail
    out = np.empty((4100, 512), np.float32)
    assert dequantize(big.reshape(-1), qtype, (4100, 512), out=out) is out
    assert np.array_equal(out, gguf.quants.dequantize(big, Q[qtype]).reshape(4100, 512))


@pytest.mark.parametrize("qtype", sorted(KQUANT_LAYOUT))
def test_decoders_extreme_scales(qtype):
    rng = np.random.default_rng(8)
    extremes = np.array([0.0, -0.0, 65504.0, -65504.0, 6e-8, -6e-8, 6.1e-5, 1.0, -2.0], np.float16)
    raw = random_blocks(qtype, 9, 512, rng, scales=extremes)
    ref = gguf.quants.dequantize(raw, Q[qtype]).reshape(9, 512)
    got = dequantize(raw, qtype, (9, 512))
    assert np.array_equal(got, ref, equal_nan=True)
    for fill in (0x00, 0xFF):  # all-zero and all-ones code bytes
        raw2 = raw.copy().reshape(-1, KQUANT_LAYOUT[qtype][1])
        keep = np.zeros(raw2.shape[1], bool)
        for off in F16_OFFSETS[qtype]:
            keep[off:off + 2] = True
        raw2[:, ~keep] = fill
        ref2 = gguf.quants.dequantize(raw2, Q[qtype]).reshape(-1)
        assert np.array_equal(dequantize(raw2, qtype, (9, 512)).reshape(-1), ref2, equal_nan=True)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
def test_kquant_fields_rebuild_weights(qtype):
    raw = random_blocks(qtype, 4, 512, np.random.default_rng(9))
    d, m, q = kquant_fields(raw.reshape(-1, KQUANT_LAYOUT[qtype][1]), qtype)
    assert d.shape == m.shape == (8, 8) and q.shape == (8, 256) and q.max() < (16 if qtype == "Q4_K" else 32)
    w = d[:, :, None] * q.reshape(8, 8, 32).astype(np.float32) - m[:, :, None]
    assert np.array_equal(w.reshape(4, 512), gguf.quants.dequantize(raw, Q[qtype]).reshape(4, 512))


def test_kquant_errors_name_the_problem():
    with pytest.raises(TandemError, match=r"multiple of 256"):
        dequantize(np.zeros(144, np.uint8), "Q4_K", (1, 128))
    with pytest.raises(TandemError, match=r"unsupported tensor type IQ2_XXS.*Q6_K"):
        dequantize(np.zeros(66, np.uint8), "IQ2_XXS", (256,))
    with pytest.raises(TandemError, match="bytes"):
        dequantize(np.zeros(100, np.uint8), "Q6_K", (1, 256))


@pytest.mark.parametrize("qtype, kind", [("Q4_K", "Q4KWeight"), ("Q5_0", "GGUFBlockWeight"),
                                         ("IQ4_NL", "BlockInt8Weight"), ("Q6_K", "GGUFBlockWeight"),
                                         ("Q5_K", "GGUFBlockWeight"), ("Q2_K", "Fp32Weight")])
def test_kernel_weights_from_kquants_are_exact(qtype, kind):
    """Packed kernel formats hold every weight exactly as gguf decodes it, and the gemv agrees."""
    import torch
    from online.kernels.ffn import QuantizedLinear
    from online.kernels.quantize import weight_from_gguf

    raw = random_blocks(qtype, 6, 512, np.random.default_rng(10))
    packed = weight_from_gguf(raw, qtype, (6, 512))
    assert type(packed).__name__ == kind
    ref = gguf.quants.dequantize(raw, Q[qtype]).reshape(6, 512)
    assert np.array_equal(packed.dequantize(), ref)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))  # [T, in]
    y = QuantizedLinear(packed).forward(x)  # [T, 6]
    expect = x.double() @ torch.from_numpy(ref).double().T  # [T, 6]
    assert (y.double() - expect).abs().max() <= 2e-2 * expect.abs().max()
