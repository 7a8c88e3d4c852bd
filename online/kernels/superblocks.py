"""GGUF Q4_K super-blocks (and Q5_0 / Q5_K / Q6_K blocks) as packed weights the fused C step reads
in place (native/blocks.h, native/kquants.h).

``GGUFBlockWeight`` keeps a Q5_0 (22 B / 32), Q6_K (210 B / 256) or Q5_K (176 B / 256) tensor's
blocks exactly as the file stores them, [out, blocks per row x block bytes]; the C row-dot kernels
decode the codes in registers; the module kernels (native/module.h) dequantize a row at a time.

``Q4KWeight`` keeps a Q4_K tensor's 144 bytes per 256 weights (0.5625 B/weight): the 128 code bytes
re-ordered into int4's group-32 nibble order (quantize.Int4Weight: byte j of group g holds element
32g + j low and 32g + 16 + j high) and each super-block's 16 scale bytes as they are (f16 d, f16 dmin,
twelve bytes of 6-bit sub-block scales sc and minimums m). Weight i of sub-block s is
``(d * sc[s]) * q[i] - dmin * m[s]`` in float32, exactly gguf's decode.

Example::

    w = weight_from_gguf(raw.data, "Q4_K", (576, 1536))   # -> Q4KWeight
    w.nbytes == 576 * 1536 * 144 // 256                   # True
    np.array_equal(w.dequantize(), gguf.quants.dequantize(raw.data, GGMLQuantizationType.Q4_K))
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.core.errors import TandemError

from .quantize import KIND_F32, KIND_I4, KIND_I8B, KIND_Q50, KIND_Q5K, KIND_Q6K, pack_int4

QK_K = 256
SB_BYTES = 16  # per super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales and minimums
Q4K_BLOCK_BYTES = 144


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise TandemError(msg)


@dataclass(frozen=True, eq=False)
class Q4KWeight:
    packed: np.ndarray  # uint8 [out, in / 2], int4 group-32 nibble order
    sb: np.ndarray  # uint8 [out, in / 256 * 16]: each super-block's scale bytes as GGUF stores them
    group_size: int = 32  # the sub-block (one scale and minimum per 32 weights)

    def __post_init__(self) -> None:
        _check(self.group_size == 32, "Q4KWeight has sub-blocks of 32")
        ok = all(isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.ndim == 2 and a.flags.c_contiguous
                 for a in (self.packed, self.sb))
        _check(ok, "Q4KWeight.packed and .sb must be C-contiguous uint8 [out, ...]")
        rows, cols = self.shape
        _check(cols % QK_K == 0, f"Q4_K needs in_features divisible by {QK_K}, got {cols}")
        _check(self.sb.shape == (rows, cols // QK_K * SB_BYTES),
               f"Q4KWeight.sb must be [{rows}, {cols // QK_K * SB_BYTES}], got {list(self.sb.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.sb.nbytes

    def float_scales(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, minimum) float32 [out, in / 32]: d * sc and -(dmin * m) of every sub-block."""
        from tandem.core.loading.kquants import _scale_min_k4

        rows, cols = self.shape
        blocks = self.sb.reshape(-1, SB_BYTES)  # [rows * nsb, 16]
        d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16).astype(np.float32)  # [n, 1]
        dmin = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float32)
        sc, mn = _scale_min_k4(blocks[:, 4:16])  # uint8 [n, 8] each
        scale = (d * sc.astype(np.float32)).reshape(rows, cols // 32)
        minimum = -(dmin * mn.astype(np.float32)).reshape(rows, cols // 32)
        return np.ascontiguousarray(scale), np.ascontiguousarray(minimum)

    def codes(self) -> np.ndarray:
        """The 4-bit values q as uint8 [out, in] in logical order."""
        rows, cols = self.shape
        p = self.packed.reshape(rows, cols // 32, 16)
        return np.concatenate([p & np.uint8(15), p >> np.uint8(4)], axis=-1).reshape(rows, cols)

    def dequantize(self) -> np.ndarray:
        rows, cols = self.shape
        scale, minimum = self.float_scales()
        q = self.codes().reshape(rows, cols // 32, 32).astype(np.float32)
        return (q * scale[:, :, None] + minimum[:, :, None]).reshape(rows, cols)  # [out, in]


def q4k_from_blocks(blocks: np.ndarray, shape: tuple[int, int]) -> Q4KWeight:
    """Q4_K blocks uint8 [rows * in / 256, 144] of a [rows, in] tensor -> Q4KWeight (same bytes)."""
    from tandem.core.loading.kquants import _q4k_codes

    rows, cols = shape
    _check(blocks.dtype == np.uint8 and blocks.shape == (rows * cols // QK_K, Q4K_BLOCK_BYTES),
           f"Q4_K data must be {rows * cols // QK_K} blocks of {Q4K_BLOCK_BYTES} bytes")
    q = _q4k_codes(blocks[:, SB_BYTES:])  # [n, 256] logical order
    sb = np.ascontiguousarray(blocks[:, :SB_BYTES]).reshape(rows, cols // QK_K * SB_BYTES)
    return Q4KWeight(packed=pack_int4(q.reshape(rows, cols), 32), sb=sb)


IN_PLACE_BLOCKS = {"Q5_0": (32, 22, KIND_Q50), "Q6_K": (256, 210, KIND_Q6K), "Q5_K": (256, 176, KIND_Q5K)}


@dataclass(frozen=True, eq=False)
class GGUFBlockWeight:
    blocks: np.ndarray  # uint8 [out, in / block_weights * block_bytes]: the file's blocks, row by row
    qtype: str  # "Q5_0" | "Q6_K" | "Q5_K"

    def __post_init__(self) -> None:
        _check(self.qtype in IN_PLACE_BLOCKS, f"GGUFBlockWeight reads {', '.join(IN_PLACE_BLOCKS)}, not {self.qtype}")
        b = self.blocks
        _check(isinstance(b, np.ndarray) and b.dtype == np.uint8 and b.ndim == 2 and b.flags.c_contiguous,
               "GGUFBlockWeight.blocks must be C-contiguous uint8 [out, row bytes]")
        _check(b.shape[1] % IN_PLACE_BLOCKS[self.qtype][1] == 0,
               f"{self.qtype} rows must be whole blocks of {IN_PLACE_BLOCKS[self.qtype][1]} bytes")

    @property
    def kind(self) -> int:
        return IN_PLACE_BLOCKS[self.qtype][2]

    @property
    def group_size(self) -> int:
        return IN_PLACE_BLOCKS[self.qtype][0]

    @property
    def shape(self) -> tuple[int, int]:
        per, nbytes, _ = IN_PLACE_BLOCKS[self.qtype]
        return self.blocks.shape[0], self.blocks.shape[1] // nbytes * per

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self) -> np.ndarray:
        from tandem.core.loading import quants

        return quants.dequantize(self.blocks, self.qtype, self.shape)  # float32 [out, in], gguf's decode

    def int8_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """Q5_0 only: (q - 16 as int8 [out, in], d float16 [out, in / 32]): w = d (q - 16) exactly."""
        from tandem.core.loading import kquants

        _check(self.qtype == "Q5_0", f"{self.qtype} has no int8 form with one scale per 32")
        rows, cols = self.shape
        b = self.blocks.reshape(-1, 22)  # [rows * nb, 22]
        q = kquants._q5_codes(b[:, 2:6], b[:, 6:22]).astype(np.int8) - np.int8(16)  # [rows * nb, 32]
        d = np.ascontiguousarray(b[:, 0:2]).view(np.float16).reshape(rows, cols // 32)
        return np.ascontiguousarray(q.reshape(rows, cols)), np.ascontiguousarray(d)


def blocks_from_gguf(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> GGUFBlockWeight:
    """A Q5_0 / Q6_K / Q5_K tensor's bytes [rows, ...] -> GGUFBlockWeight (the same bytes)."""
    from tandem.core.loading import quants

    rows, cols = shape
    per = IN_PLACE_BLOCKS[qtype][0]
    _check(cols % per == 0, f"{qtype} needs in_features divisible by {per}, got {cols}")
    return GGUFBlockWeight(np.ascontiguousarray(quants._as_rows(data, qtype, shape)).reshape(rows, -1), qtype)
