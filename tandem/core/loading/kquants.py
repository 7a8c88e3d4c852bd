"""Numpy decoders for the GGUF block types beyond the 32-weight Q4/Q8 ones (what downloads use).

Super-block ("k-quant") layouts, 256 weights per block (``QK_K``), little endian, fields in order:

- ``Q2_K`` (84 B):  scales[16] (low nibble scale, high nibble min), qs[64] (2-bit), f16 d, f16 dmin
- ``Q3_K`` (110 B): hmask[32], qs[64] (2-bit low), scales[12] (16 x 6-bit, offset 32), f16 d
- ``Q4_K`` (144 B): f16 d, f16 dmin, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128]
- ``Q5_K`` (176 B): f16 d, f16 dmin, scales[12], qh[32] (5th bits), qs[128]
- ``Q6_K`` (210 B): ql[128] (low nibbles), qh[64] (high 2 bits), int8 scales[16], f16 d

32-weight legacy blocks: ``Q5_0`` (22 B: d, uint32 qh, qs[16]; w = d * (q - 16)), ``Q5_1`` (24 B:
d, m, qh, qs; w = d * q + m) and ``IQ4_NL`` (18 B: d, qs[16]; w = d * table[q]).

Each ``decode_*`` maps ``uint8 [n, block_bytes]`` to float32 ``[n, block_elems]`` with the same float32
operation order as ggml's reference (so the results are bit-identical to ``gguf.quants``).
``kquant_fields`` exposes the per-32-weight (scale, min, code) view that integer kernels can use.

Example::

    w = decode_q4_k(blocks_u8)                      # [n, 256] float32
    d, m, q = kquant_fields(blocks_u8, "Q4_K")      # float32 [n, 8] x2, uint8 [n, 256]; w = d * q - m
"""
from __future__ import annotations

import numpy as np

QK_K = 256
# qtype -> (elements per block, bytes per block)
KQUANT_LAYOUT = {"Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
                 "Q6_K": (QK_K, 210), "Q5_0": (32, 22), "Q5_1": (32, 24), "IQ4_NL": (32, 18)}
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8)
_E = np.arange(QK_K)  # element index within a super-block


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """float32 [n, 1] from the f16 at byte ``offset`` of each block."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte scale field [n, 12] -> 6-bit scales, mins uint8 [n, 8]."""
    q = packed.astype(np.uint8)
    sc = np.empty((q.shape[0], 8), np.uint8)
    mn = np.empty((q.shape[0], 8), np.uint8)
    sc[:, :4] = q[:, 0:4] & 63
    mn[:, :4] = q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc, mn


def _q4k_codes(qs: np.ndarray) -> np.ndarray:
    """qs [n, 128] -> codes uint8 [n, 256]: sub-block s reads bytes 32*(s//2).. , low nibble if s even."""
    chunks = qs.reshape(-1, 4, 1, 32)  # [n, 4 pairs, 1, 32]
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, QK_K)


def kquant_fields(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K blocks [n, bytes] -> (d float32 [n, 8], m float32 [n, 8], q uint8 [n, 256]).

    Weight ``i`` of sub-block ``s`` is ``d[s] * q[i] - m[s]`` (float32, ggml's order).
    """
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    if qtype == "Q4_K":
        q = _q4k_codes(blocks[:, 16:144])
    elif qtype == "Q5_K":
        qh = blocks[:, 16:48]  # [n, 32], bit s = 5th bit of sub-block s
        high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
        q = _q4k_codes(blocks[:, 48:176]) | (high.reshape(-1, QK_K) << 4)
    else:
        raise ValueError(qtype)
    return d * sc.astype(np.float32), dmin * mn.astype(np.float32), q


def decode_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, m, q = kquant_fields(blocks, "Q4_K")
    return (d[:, :, None] * q.reshape(-1, 8, 32).astype(np.float32) - m[:, :, None]).reshape(-1, QK_K)


def decode_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, m, q = kquant_fields(blocks, "Q5_K")
    return (d[:, :, None] * q.reshape(-1, 8, 32).astype(np.float32) - m[:, :, None]).reshape(-1, QK_K)


def decode_q6_k(blocks: np.ndarray) -> np.ndarray:
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 2, 32)  # [n, half, nibble, k%2, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [n, half, 1, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # [n, half, k, l]
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    high = (qh >> shifts) & 3  # [n, half, k, l]
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(-1, 16, 16)  # [n, 16 groups, 16]
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(blocks, 208)
    return ((d * scales)[:, :, None] * q.astype(np.float32)).reshape(-1, QK_K)


def decode_q2_k(blocks: np.ndarray) -> np.ndarray:
    scales = blocks[:, 0:16]  # [n, 16]
    qs = blocks[:, 16:80]  # [n, 64]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = d * (scales & 0x0F).astype(np.float32)  # [n, 16]
    ml = dmin * (scales >> 4).astype(np.float32)
    byte = qs[:, 32 * (_E // 128) + _E % 32]  # [n, 256]
    q = (byte >> (2 * ((_E % 128) // 32)).astype(np.uint8)) & 3
    return (dl[:, _E // 16] * q.astype(np.float32) - ml[:, _E // 16])


def decode_q3_k(blocks: np.ndarray) -> np.ndarray:
    hmask = blocks[:, 0:32]
    qs = blocks[:, 32:96]
    raw = blocks[:, 96:108]
    d = _f16(blocks, 108)
    i = np.arange(16)
    low = np.where(i < 8, raw[:, i % 8] & 0x0F, raw[:, i % 8] >> 4)  # [n, 16]
    high = (raw[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    scales = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)  # [n, 16]
    byte = qs[:, 32 * (_E // 128) + _E % 32]
    q2 = (byte >> (2 * ((_E % 128) // 32)).astype(np.uint8)) & 3
    hbit = (hmask[:, _E % 32] >> (_E // 32).astype(np.uint8)) & 1
    q = q2.astype(np.int8) - ((1 - hbit).astype(np.int8) << 2)
    return (d * scales)[:, _E // 16] * q.astype(np.float32)


def _q5_codes(qh_bytes: np.ndarray, qs: np.ndarray) -> np.ndarray:
    qh = np.ascontiguousarray(qh_bytes).view(np.uint32)  # [n, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, 32]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1) | (high << 4)


def decode_q5_0(blocks: np.ndarray) -> np.ndarray:
    q = _q5_codes(blocks[:, 2:6], blocks[:, 6:22]).astype(np.int8) - np.int8(16)
    return _f16(blocks, 0) * q.astype(np.float32)


def decode_q5_1(blocks: np.ndarray) -> np.ndarray:
    q = _q5_codes(blocks[:, 4:8], blocks[:, 8:24])
    return _f16(blocks, 0) * q.astype(np.float32) + _f16(blocks, 2)


def decode_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    qs = blocks[:, 2:18]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return _f16(blocks, 0) * IQ4_NL_VALUES[codes].astype(np.float32)


DECODERS = {"Q2_K": decode_q2_k, "Q3_K": decode_q3_k, "Q4_K": decode_q4_k, "Q5_K": decode_q5_k,
            "Q6_K": decode_q6_k, "Q5_0": decode_q5_0, "Q5_1": decode_q5_1, "IQ4_NL": decode_iq4_nl}
