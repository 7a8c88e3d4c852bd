"""Numpy decoders for the GGUF tensor encodings Tandem reads.

Block layouts (32 weights per block, little endian, blocks laid out row by row):

- ``Q8_0`` (34 bytes): f16 scale ``d``, 32 x int8 ``q``;             w = d * q
- ``Q4_0`` (18 bytes): f16 scale ``d``, 16 bytes of nibbles;         w = d * (q - 8)
- ``Q4_1`` (20 bytes): f16 scale ``d``, f16 minimum ``m``, 16 bytes;  w = d * q + m
  (low nibbles are elements 0-15 of the block, high nibbles elements 16-31)
- ``F32`` / ``F16`` / ``BF16``: plain element arrays.
- k-quants ``Q2_K`` .. ``Q6_K`` (256 weights per block), ``Q5_0``, ``Q5_1``, ``IQ4_NL``: see ``kquants``.

``dequantize`` decodes to float32 in row chunks, optionally straight into a caller's buffer (so a
torch tensor can be filled without an intermediate copy). The ``split_*`` helpers return the raw
block fields (scales as float16, quants as small integers) for integer kernels.

Example::

    w = dequantize(raw_uint8, "Q4_1", (1536, 576))       # float32 [1536, 576]
    d, m, q = split_q4_1(raw_uint8, (1536, 576))        # [1536, 18] f16 x2, uint8 [1536, 576]
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from tandem.core.errors import TandemError

from .kquants import DECODERS as _KQUANT_DECODERS, KQUANT_LAYOUT

QK = 32  # weights per quantized block
SUPPORTED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# qtype -> (elements per block, bytes per block)
BLOCK_LAYOUT = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
                "Q8_0": (QK, 2 + QK), "Q4_0": (QK, 2 + QK // 2), "Q4_1": (QK, 4 + QK // 2), **KQUANT_LAYOUT}
_CHUNK_ELEMENTS = 1 << 20  # decode this many weights at a time (bounded temporaries)


def qtype_name(qtype: Any) -> str:
    """Canonical name ("Q4_1", ...) of a str / ``gguf.GGMLQuantizationType``; unknown -> TandemError."""
    name = getattr(qtype, "name", qtype)
    if not isinstance(name, str) or name.upper() not in BLOCK_LAYOUT:
        raise TandemError(f"unsupported tensor type {name} (supported: {', '.join(SUPPORTED_QTYPES)})")
    return name.upper()


def row_nbytes(qtype: str, cols: int) -> int:
    """Bytes one row of ``cols`` weights takes on disk."""
    block_elems, block_bytes = BLOCK_LAYOUT[qtype_name(qtype)]
    if cols % block_elems:
        raise TandemError(f"{qtype} rows need a multiple of {block_elems} columns, got {cols}")
    return cols // block_elems * block_bytes


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def _as_rows(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The raw bytes as ``uint8 [rows, row_bytes]`` (a view when possible)."""
    rows, cols = _rows_cols(shape)
    nbytes = row_nbytes(qtype, cols)
    flat = np.asarray(data)
    if flat.dtype != np.uint8:
        flat = flat.view(np.uint8) if flat.flags.c_contiguous else np.ascontiguousarray(flat).view(np.uint8)
    if flat.size != rows * nbytes:
        raise TandemError(f"{qtype} tensor of shape {list(shape)} needs {rows * nbytes} bytes, got {flat.size}")
    return flat.reshape(rows, nbytes)


def _f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 stored at byte ``offset`` of every block: [..., nblocks] f16."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] packed bytes -> [..., 32] values 0..15 (low nibbles first, then high)."""
    return np.concatenate([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=-1)


def _decode_rows(rows_u8: np.ndarray, qtype: str, cols: int, out: np.ndarray) -> None:
    """Decode ``rows_u8 [r, row_bytes]`` into ``out [r, cols]`` float32."""
    r = rows_u8.shape[0]
    if qtype == "F32":
        out[...] = np.ascontiguousarray(rows_u8).view(np.float32)
        return
    if qtype == "F16":
        out[...] = np.ascontiguousarray(rows_u8).view(np.float16)
        return
    if qtype == "BF16":
        bits = np.ascontiguousarray(rows_u8).view(np.uint16).astype(np.uint32) << np.uint32(16)  # [r, cols]
        out[...] = bits.view(np.float32)
        return
    if qtype in _KQUANT_DECODERS:
        block_elems, block_bytes = BLOCK_LAYOUT[qtype]
        flat_blocks = np.ascontiguousarray(rows_u8).reshape(-1, block_bytes)  # [r * nb, block_bytes]
        out.reshape(-1, block_elems)[...] = _KQUANT_DECODERS[qtype](flat_blocks)
        return
    nblocks = cols // QK
    blocks = rows_u8.reshape(r, nblocks, BLOCK_LAYOUT[qtype][1])  # [r, nb, block_bytes]
    out3 = out.reshape(r, nblocks, QK)  # [r, nb, 32]
    d = _f16_field(blocks, 0).astype(np.float32)[..., None]  # [r, nb, 1]
    if qtype == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)  # [r, nb, 32]
        np.multiply(q, d, out=out3, casting="unsafe")
    elif qtype == "Q4_0":
        q = _nibbles(blocks[..., 2:]).view(np.int8) - np.int8(8)  # [r, nb, 32]
        np.multiply(q, d, out=out3, casting="unsafe")
    elif qtype == "Q4_1":
        m = _f16_field(blocks, 2).astype(np.float32)[..., None]  # [r, nb, 1]
        q = _nibbles(blocks[..., 4:])  # [r, nb, 32]
        np.multiply(q, d, out=out3, casting="unsafe")
        out3 += m


def dequantize(data: np.ndarray, qtype: Any, shape: tuple[int, ...],
               out: np.ndarray | None = None) -> np.ndarray:
    """Decode a GGUF tensor's bytes to float32 of logical ``shape`` (torch order, last dim contiguous).

    ``out`` (float32, C-contiguous, ``shape``) is filled in place when given and returned.
    """
    qtype = qtype_name(qtype)
    shape = tuple(int(s) for s in shape)
    rows, cols = _rows_cols(shape)
    rows_u8 = _as_rows(data, qtype, shape)  # [rows, row_bytes]
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise TandemError(f"dequantize: output buffer must be float32 C-contiguous {list(shape)}")
    out2 = out.reshape(rows, cols)  # [rows, cols] view
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        _decode_rows(rows_u8[start:stop], qtype, cols, out2[start:stop])
    return out


def _blocks(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> tuple[np.ndarray, int, int]:
    rows, cols = _rows_cols(shape)
    if qtype_name(qtype) != qtype:
        raise TandemError(f"expected a {qtype} tensor")
    rows_u8 = _as_rows(data, qtype, shape)
    return rows_u8.reshape(rows, cols // QK, BLOCK_LAYOUT[qtype][1]), rows, cols


def split_q8_0(data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 fields: ``d`` float16 [rows, nblocks], ``q`` int8 [rows, cols]; w = d * q."""
    blocks, rows, cols = _blocks(data, "Q8_0", shape)
    d = _f16_field(blocks, 0)  # [rows, nb]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)  # [rows, cols]
    return d, q


def split_q4_0(data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 fields: ``d`` float16 [rows, nblocks], ``q`` uint8 0..15 [rows, cols]; w = d * (q - 8)."""
    blocks, rows, cols = _blocks(data, "Q4_0", shape)
    return _f16_field(blocks, 0), _nibbles(blocks[..., 2:]).reshape(rows, cols)


def split_q4_1(data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 fields: ``d``, ``m`` float16 [rows, nblocks], ``q`` uint8 0..15 [rows, cols]; w = d * q + m."""
    blocks, rows, cols = _blocks(data, "Q4_1", shape)
    return _f16_field(blocks, 0), _f16_field(blocks, 2), _nibbles(blocks[..., 4:]).reshape(rows, cols)
