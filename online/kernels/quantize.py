"""Packed weight formats for the CPU kernels, and conversions from float and from GGUF blocks.

Every format is a frozen dataclass over numpy arrays, ``[out_features, in_features]`` logically:

- ``Fp32Weight``: float32 ``w``.
- ``Fp16Weight``: float16 ``w`` (in_features divisible by 8): half the bytes of fp32, 11-bit mantissa
  (a GGUF Q4_1 value d*q+m with f16 d, m rounds by at most 2^-11 relative).
- ``Int8Weight``: int8 ``q`` + float32 per-output-row ``scale`` (symmetric): w = scale[r] * q.
- ``BlockInt8Weight``: int8 ``q`` + ``scale [out, in/32]`` float16 (GGUF Q8_0 as is) or float32.
- ``Int4Weight``: groups of ``group_size`` (32 or 64) along the input dim; ``packed uint8 [out, in/2]``:
  inside group g, byte j holds element g*G + j in its low nibble and element g*G + G/2 + j in its
  high nibble (GGUF Q4_0/Q4_1 order for G = 32); w = scale[r, g] * q + minimum[r, g], q in 0..15.
  scale and minimum are float16 (GGUF's own: 0.625 B/weight) or float32; ``minimum=None`` means
  w = scale * (q - 8) (Q4_0: 0.5625 B/weight).
- ``superblocks.Q4KWeight``: Q4_K super-blocks (0.5625 B/weight), codes in the group-32 order above.

GGUF blocks convert without a float round trip: Q8_0 -> BlockInt8Weight, Q4_1 / Q4_0 -> Int4Weight, Q4_K
-> Q4KWeight, Q5_0 / Q5_K / Q6_K -> superblocks.GGUFBlockWeight (the file's blocks), IQ4_NL -> BlockInt8Weight
(table values), all with GGUF's f16 scales; F32/F16/BF16, Q2_K, Q3_K, Q5_1 decode exactly to Fp32Weight. Quantized floats get f16 scales where they hold them.
The C kernels read the f16, Q4_K and GGUFBlockWeight forms in place (native/blocks.h, kquants.h).

Example::

    w8 = quantize_int8(w)                    # w: float32 [1536, 576]
    w4 = quantize_int4(w, group_size=32)
    w4.nbytes, w4.dequantize().shape          # 663552, (1536, 576)
    wq = weight_from_gguf(raw.data, raw.qtype, raw.shape)   # tandem.core.loading.checkpoint.RawQuantTensor
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Union

import numpy as np

from tandem.core.errors import TandemError

# Kernel codes (the native kernels dispatch on these; the C enums in kernels/native must
# agree: tests/test_kernel_constants.py): weight formats and FFN activations.
KIND_F32, KIND_I8, KIND_I8B, KIND_I4, KIND_F16 = 0, 1, 2, 3, 4
KIND_I4H, KIND_I8H, KIND_Q4K = 5, 6, 7  # native only (blocks.h): f16-scaled int4 / int8, Q4_K super-blocks
KIND_Q50, KIND_Q6K, KIND_Q5K = 8, 9, 10  # native only (kquants.h): GGUF Q5_0 / Q6_K / Q5_K blocks
KIND_I4X8, KIND_I8X8 = 11, 12  # native only (blocks_x8.h): Q4_0 / Q4_1 and Q8_0 rows interleaved eight at a time
ACT_IDS = {"silu": 0, "relu": 1, "fatrelu": 2, "drelu": 3, "gelu": 4, "gelu_tanh": 5}
F16_VECTOR = 8  # Fp16Weight rows are read 8 values at a time
Q8_BLOCK = 32  # Q8_0 block size (BlockInt8Weight)
INT4_GROUP_SIZES = (32, 64)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise TandemError(msg)


def _scale_array(a: Any, shape: tuple, name: str) -> None:
    _check(isinstance(a, np.ndarray) and a.dtype in (np.float16, np.float32) and a.shape == shape
           and a.flags.c_contiguous, f"{name} must be C-contiguous float16 or float32 {list(shape)}")


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)  # float16 -> float32 is exact


def _half_scales(*arrays: np.ndarray) -> tuple:
    """float32 scale arrays as float16 when every value is 0 or a normal float16 (else unchanged),
    so quantized floats keep GGUF's scale bytes without subnormal precision loss."""
    fits = all(bool(((a == 0) | ((np.abs(a) >= 2.0 ** -14) & (np.abs(a) <= 65504.0))).all()) for a in arrays)
    return tuple(a.astype(np.float16) if fits else a for a in arrays)


def _f32_2d(a: Any, name: str) -> np.ndarray:
    a = np.asarray(a)
    _check(a.ndim == 2, f"{name} must be 2-D [out, in], got shape {list(a.shape)}")
    _check(np.issubdtype(a.dtype, np.floating), f"{name} must be floating point, got {a.dtype}")
    out = np.ascontiguousarray(a, dtype=np.float32)
    _check(bool(np.isfinite(out).all()), f"{name} contains NaN or infinity")
    return out


@dataclass(frozen=True, eq=False)
class _FloatWeight:
    w: np.ndarray  # [out, in] in DTYPE
    DTYPE: ClassVar[type] = np.float32
    KIND: ClassVar[int] = KIND_F32

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check(self.w.dtype == self.DTYPE and self.w.ndim == 2 and self.w.flags.c_contiguous,
               f"{name} needs a C-contiguous {np.dtype(self.DTYPE).name} [out, in] array")

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def dequantize(self) -> np.ndarray:
        return self.w.astype(np.float32, copy=False)


@dataclass(frozen=True, eq=False)
class Fp32Weight(_FloatWeight):
    pass


@dataclass(frozen=True, eq=False)
class Fp16Weight(_FloatWeight):
    DTYPE: ClassVar[type] = np.float16
    KIND: ClassVar[int] = KIND_F16

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.w.shape[1] % F16_VECTOR == 0,
               f"Fp16Weight needs in_features divisible by {F16_VECTOR}, got {self.w.shape[1]}")


@dataclass(frozen=True, eq=False)
class _Int8Codes:
    q: np.ndarray  # int8 [out, in]
    scale: np.ndarray  # float32, layout set by the subclass

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check(self.q.dtype == np.int8 and self.q.ndim == 2 and self.q.flags.c_contiguous,
               f"{name}.q must be C-contiguous int8 [out, in]")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


@dataclass(frozen=True, eq=False)
class Int8Weight(_Int8Codes):
    scale: np.ndarray  # float32 [out]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.scale.dtype == np.float32 and self.scale.shape == (self.q.shape[0],),
               f"Int8Weight.scale must be float32 [{self.q.shape[0]}]")

    def dequantize(self) -> np.ndarray:
        return self.q.astype(np.float32) * self.scale[:, None]  # [out, in]


@dataclass(frozen=True, eq=False)
class BlockInt8Weight(_Int8Codes):
    scale: np.ndarray  # float16 or float32 [out, in / 32]

    def __post_init__(self) -> None:
        super().__post_init__()
        rows, cols = self.q.shape
        _check(cols % Q8_BLOCK == 0, f"BlockInt8Weight needs in_features divisible by {Q8_BLOCK}, got {cols}")
        _scale_array(self.scale, (rows, cols // Q8_BLOCK), "BlockInt8Weight.scale")

    def dequantize(self) -> np.ndarray:
        rows, cols = self.q.shape
        w = self.q.reshape(rows, -1, Q8_BLOCK).astype(np.float32) * _f32(self.scale)[:, :, None]
        return w.reshape(rows, cols)


@dataclass(frozen=True, eq=False)
class Int4Weight:
    packed: np.ndarray  # uint8 [out, in / 2], nibble order described in the module docstring
    scale: np.ndarray  # float16 or float32 [out, in / group_size]
    minimum: np.ndarray | None  # like scale; None: w = scale * (q - 8) (Q4_0)
    group_size: int = 32

    def __post_init__(self) -> None:
        _check(self.group_size in INT4_GROUP_SIZES, f"int4 group size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
        _check(self.packed.dtype == np.uint8 and self.packed.ndim == 2 and self.packed.flags.c_contiguous,
               "Int4Weight.packed must be C-contiguous uint8 [out, in/2]")
        rows, cols = self.packed.shape[0], self.packed.shape[1] * 2
        _check(cols % self.group_size == 0, f"Int4Weight needs in_features divisible by {self.group_size}, got {cols}")
        groups = (rows, cols // self.group_size)
        _scale_array(self.scale, groups, "Int4Weight.scale")
        if self.minimum is not None:
            _scale_array(self.minimum, groups, "Int4Weight.minimum")
            _check(self.minimum.dtype == self.scale.dtype, "Int4Weight.scale and .minimum must have one dtype")
        _check(self.scale.dtype == np.float32 or self.group_size == 32, "float16 int4 scales need groups of 32")

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + (0 if self.minimum is None else self.minimum.nbytes)

    def float_scales(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, minimum) as float32 [out, groups] (exact; minimum = -8 scale without one)."""
        scale = _f32(self.scale)
        return scale, (-8.0 * scale).astype(np.float32) if self.minimum is None else _f32(self.minimum)

    def codes(self) -> np.ndarray:
        """The 4-bit values q as uint8 [out, in] in logical order."""
        rows, cols = self.shape
        p = self.packed.reshape(rows, cols // self.group_size, self.group_size // 2)  # [out, groups, G/2]
        q = np.concatenate([p & np.uint8(15), p >> np.uint8(4)], axis=-1)  # [out, groups, G]
        return q.reshape(rows, cols)

    def dequantize(self) -> np.ndarray:
        rows, cols = self.shape
        q = self.codes().reshape(rows, -1, self.group_size).astype(np.float32)
        scale, minimum = self.float_scales()
        w = q * scale[:, :, None] + minimum[:, :, None]  # [out, groups, G]
        return w.reshape(rows, cols)


Weight = Union[Fp32Weight, Fp16Weight, Int8Weight, BlockInt8Weight, Int4Weight]
FORMATS = ("fp32", "fp16", "int8", "int8b", "int4")


def quantize_int8(w: Any) -> Int8Weight:
    """Symmetric per-output-row int8: scale = max|w[r]| / 127."""
    w = _f32_2d(w, "weight")
    amax = np.abs(w).max(axis=1)  # [out]
    scale = (amax / 127.0).astype(np.float32)
    inv = np.where(scale > 0, 1.0 / np.where(scale > 0, scale, 1.0), 0.0).astype(np.float32)
    q = np.clip(np.rint(w * inv[:, None]), -127, 127).astype(np.int8)
    return Int8Weight(q=q, scale=scale)


def pack_int4(q: np.ndarray, group_size: int) -> np.ndarray:
    """Values 0..15 uint8 [out, in] (logical order) -> packed uint8 [out, in/2] in the kernel layout."""
    rows, cols = q.shape
    g = q.reshape(rows, cols // group_size, group_size).astype(np.uint8)  # [out, groups, G]
    half = group_size // 2
    packed = g[..., :half] | (g[..., half:] << np.uint8(4))  # [out, groups, G/2]
    return np.ascontiguousarray(packed.reshape(rows, cols // 2))


def quantize_int4(w: Any, group_size: int = 32) -> Int4Weight:
    """Asymmetric int4 per group along the input dim (Q4_1 style): w ~ scale * q + minimum."""
    _check(group_size in INT4_GROUP_SIZES, f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    w = _f32_2d(w, "weight")
    rows, cols = w.shape
    _check(cols % group_size == 0, f"int4 needs in_features divisible by {group_size}, got {cols}")
    g = w.reshape(rows, cols // group_size, group_size)  # [out, groups, G]
    lo, hi = g.min(axis=-1), g.max(axis=-1)  # [out, groups]
    scale, lo = ((hi - lo) / 15.0).astype(np.float32), lo.astype(np.float32)
    if group_size == 32:
        scale, lo = _half_scales(scale, lo)  # the codes below are chosen against the stored (rounded) values
    s32, lo32 = _f32(scale), _f32(lo)
    inv = np.where(s32 > 0, 1.0 / np.where(s32 > 0, s32, 1.0), 0.0).astype(np.float32)
    q = np.clip(np.rint((g - lo32[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    return Int4Weight(packed=pack_int4(q.reshape(rows, cols), group_size), scale=np.ascontiguousarray(scale),
                      minimum=np.ascontiguousarray(lo), group_size=group_size)


def quantize_int8_blocks(w: Any) -> BlockInt8Weight:
    """Symmetric int8 with one scale per 32 inputs (Q8_0-style); per-row int8 when in % 32 != 0
    is not possible here, so callers fall back to ``quantize_int8``."""
    w = _f32_2d(w, "weight")
    rows, cols = w.shape
    _check(cols % Q8_BLOCK == 0, f"block int8 needs in_features divisible by {Q8_BLOCK}, got {cols}")
    blocks = w.reshape(rows, cols // Q8_BLOCK, Q8_BLOCK)  # [out, in/32, 32]
    scale, = _half_scales((np.abs(blocks).max(axis=2) / 127.0).astype(np.float32))  # [out, in/32]
    s32 = _f32(scale)
    safe = np.where(s32 > 0, s32, 1.0)
    q = np.clip(np.rint(blocks / safe[:, :, None]), -127, 127).astype(np.int8).reshape(rows, cols)
    return BlockInt8Weight(q=np.ascontiguousarray(q), scale=np.ascontiguousarray(scale))


def quantize(w: Any, fmt: str, group_size: int = 32) -> Weight:
    """Float [out, in] -> the given format ("fp32" | "fp16" | "int8" | "int8b" | "int4").

    "int8b" keeps one scale per 32 inputs (as GGUF Q8_0): ~3x less error than per-row "int8"
    on weights whose scale varies along a row (e.g. a transposed GGUF down projection).
    """
    if fmt == "fp32":
        return Fp32Weight(_f32_2d(w, "weight"))
    if fmt == "fp16":
        w = _f32_2d(w, "weight")
        _check(bool((np.abs(w) <= 65504.0).all()), "weight exceeds the float16 range")
        return Fp16Weight(w.astype(np.float16))
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "int8b":
        w = _f32_2d(w, "weight")
        return quantize_int8_blocks(w) if w.shape[1] % Q8_BLOCK == 0 else quantize_int8(w)
    if fmt == "int4":
        return quantize_int4(w, group_size)
    raise TandemError(f"unknown weight format {fmt!r} (choose from {', '.join(FORMATS)})")


def _scales(a: Any, shape: tuple[int, int], name: str) -> np.ndarray:
    a = np.asarray(a)
    _check(a.shape == shape, f"{name} must have shape {list(shape)}, got {list(a.shape)}")
    return np.ascontiguousarray(a, dtype=np.float16 if a.dtype == np.float16 else np.float32)  # GGUF's f16 kept


def int8_from_q8_0(d: Any, q: Any) -> BlockInt8Weight:
    """GGUF Q8_0 fields (``d`` f16 [out, in/32], ``q`` int8 [out, in]) -> BlockInt8Weight, exactly."""
    q = np.ascontiguousarray(q)
    _check(q.dtype == np.int8 and q.ndim == 2, "Q8_0 quants must be int8 [out, in]")
    _check(q.shape[1] % Q8_BLOCK == 0, f"Q8_0 needs in_features divisible by {Q8_BLOCK}")
    return BlockInt8Weight(q=q, scale=_scales(d, (q.shape[0], q.shape[1] // Q8_BLOCK), "Q8_0 scales"))


def _codes(q: Any) -> np.ndarray:
    q = np.asarray(q)
    _check(q.ndim == 2 and q.shape[1] % 32 == 0, "Q4 quants must be [out, in] with in divisible by 32")
    _check(q.dtype == np.uint8 and int(q.max(initial=0)) < 16, "Q4 quants must be uint8 values 0..15")
    return q


def int4_from_q4_1(d: Any, m: Any, q: Any) -> Int4Weight:
    """GGUF Q4_1 fields (``d``, ``m`` f16 [out, in/32], ``q`` uint8 0..15 [out, in]): w = d q + m, exactly."""
    q = _codes(q)
    groups = (q.shape[0], q.shape[1] // 32)
    return Int4Weight(packed=pack_int4(q, 32), scale=_scales(d, groups, "Q4_1 scales"),
                      minimum=_scales(m, groups, "Q4_1 minimums"), group_size=32)


def int4_from_q4_0(d: Any, q: Any) -> Int4Weight:
    """GGUF Q4_0 fields (``d`` f16 [out, in/32], ``q`` uint8 0..15 [out, in]): w = d (q - 8), exactly."""
    q = _codes(q)
    scale = _scales(d, (q.shape[0], q.shape[1] // 32), "Q4_0 scales")
    return Int4Weight(packed=pack_int4(q, 32), scale=scale, minimum=None, group_size=32)


def concat_rows(weights: list[Weight]) -> Weight:
    """Stack weights of one format along the output dim (e.g. q, k, v -> one projection, one call)."""
    _check(len(weights) > 0, "concat_rows needs at least one weight")
    first = weights[0]
    def layout(w: Weight) -> tuple:  # the format, group size, input width and every array's dtype (or None)
        return (type(w), w.shape[1], getattr(w, "group_size", 0), getattr(w, "qtype", None),
                *(getattr(getattr(w, n), "dtype", None) for n in w.__dataclass_fields__))
    _check(all(layout(w) == layout(first) for w in weights),
           "concat_rows needs weights of one format, group size, input width and scale type")
    fields = {}
    for name in first.__dataclass_fields__:
        value = getattr(first, name)
        fields[name] = (np.ascontiguousarray(np.concatenate([getattr(w, name) for w in weights], axis=0))
                        if isinstance(value, np.ndarray) else value)
    return type(first)(**fields)


def weight_from_gguf(data: np.ndarray, qtype: Any, shape: tuple[int, ...]) -> Weight:
    """A GGUF tensor's raw bytes -> packed weight without a float round trip (module docstring)."""
    from tandem.core.loading import quants

    qtype = quants.qtype_name(qtype)
    shape = tuple(int(s) for s in shape)
    _check(len(shape) == 2, f"expected a 2-D weight, got shape {list(shape)}")
    if qtype == "Q8_0":
        return int8_from_q8_0(*quants.split_q8_0(data, shape))
    if qtype == "Q4_1":
        return int4_from_q4_1(*quants.split_q4_1(data, shape))
    if qtype == "Q4_0":
        return int4_from_q4_0(*quants.split_q4_0(data, shape))
    if qtype in ("Q5_0", "Q6_K", "Q5_K"):
        from .superblocks import blocks_from_gguf
        return blocks_from_gguf(data, qtype, shape)
    if qtype in ("Q4_K", "IQ4_NL"):
        return _from_kquant(data, qtype, shape)
    return Fp32Weight(quants.dequantize(data, qtype, shape))


def _from_kquant(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> Weight:
    """Q4_K -> Q4KWeight, IQ4_NL -> BlockInt8Weight; every weight equal to gguf's decode."""
    from tandem.core.loading import kquants, quants

    from .superblocks import q4k_from_blocks

    rows, cols = shape
    blocks = quants._as_rows(data, qtype, shape).reshape(-1, quants.BLOCK_LAYOUT[qtype][1])  # [rows * nb, bytes]
    groups = (rows, cols // 32)
    if qtype == "Q4_K":
        return q4k_from_blocks(blocks, shape)
    d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16).reshape(groups)
    qs = blocks[:, 2:18]  # IQ4_NL: table values
    q = kquants.IQ4_NL_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=1)]  # [rows * nb, 32]
    return int8_from_q8_0(d, q.reshape(rows, cols))
