"""Weights on the GPU tier in the plan's format (``tandem.core.tier_format``), with dequantizing
matmuls in torch ops (CPU and CUDA).

GGUF tensors whose block type is a tier format (F32, F16, Q8_0, Q4_0, Q4_1) are stored with their blocks
as they are (``TierMatrix.from_raw``); others are decoded and packed. On a CPU tier the matrices are read
through the CPU kernels (``online.kernels``: the C row kernels) over the same codes, with
no dequantization per call; on CUDA through dequantize + matmul.

Example::

    m = TierMatrix.pack(w, "q4", tier, "layers.3.hot_up")    # w [R, C] float32, bytes charged to the tier
    m = TierMatrix.from_raw(ckpt.raw[name], "q4_1", tier, "layers.3.hot_up", rows=hot)  # GGUF rows as they are
    y = m.linear(x)                                          # x [T, C] on the tier -> [T, R]
    m.nbytes                                                 # R * C * 0.5625
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tandem.core.errors import TandemError
from tandem.core.tier_format import _RAW_AS_IS, BLOCK, TIER_FORMATS, tier_matrix_bytes


def _pad_cols(w: torch.Tensor) -> torch.Tensor:
    pad = (-w.shape[1]) % BLOCK
    return F.pad(w, (0, pad)) if pad else w


@dataclass
class TierMatrix:
    """``[rows, cols]`` weights on the tier; ``data`` holds codes (or floats), ``scale`` the block scales."""
    fmt: str
    rows: int
    cols: int
    data: torch.Tensor
    scale: torch.Tensor | None = None
    minimum: torch.Tensor | None = None  # q4_1 only
    threads: int = 1  # CPU-kernel threads on a CPU tier
    _kernel: object = field(default=None, repr=False, compare=False)  # online.kernels QuantizedLinear (CPU tier)

    @classmethod
    def from_raw(cls, raw, fmt: str, tier, name: str, rows: torch.Tensor | None = None) -> "TierMatrix":
        """A GGUF tensor (``RawQuantTensor``: qtype, shape, data) or its ``rows``, in ``fmt``: its blocks as they
        are when its type is ``fmt`` (Q8_0 -> q8, Q4_0 -> q4, Q4_1 -> q4_1, F32, F16), else decoded and packed."""
        from tandem.core.loading import quants
        qtype, shape = quants.qtype_name(raw.qtype), tuple(int(s) for s in raw.shape)
        as_is, head = _RAW_AS_IS.get(qtype, (None, 0))
        if as_is != fmt or len(shape) != 2 or (head and shape[1] % BLOCK):
            w = torch.from_numpy(quants.dequantize(raw.data, qtype, shape))  # [R, C]
            return cls.pack(w if rows is None else w[rows], fmt, tier, name, threads=tier_threads(tier))
        blocks = quants._as_rows(raw.data, qtype, shape)  # [R, row bytes] uint8
        if rows is not None:
            blocks = blocks[rows.numpy()]
        n = blocks.shape[0]
        threads = tier_threads(tier)
        if fmt in ("fp32", "fp16"):
            values = torch.from_numpy(np.array(blocks).view(np.float32 if fmt == "fp32" else np.float16))  # a copy
            return cls(fmt, n, shape[1], tier.allocate(name, values.reshape(n, shape[1]).contiguous()), threads=threads)
        blocks = np.ascontiguousarray(blocks).reshape(n, shape[1] // BLOCK, -1)  # [R, C/32, block bytes]

        def f16(offset: int) -> torch.Tensor:  # [R, C/32]
            return torch.from_numpy(np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0])
        codes = np.ascontiguousarray(blocks[..., head:]).reshape(n, -1)
        data = torch.from_numpy(codes.view(np.int8) if fmt == "q8" else codes)
        minimum = tier.allocate(name + ".min", f16(2).contiguous()) if fmt == "q4_1" else None
        return cls(fmt, n, shape[1], tier.allocate(name, data), tier.allocate(name + ".scale", f16(0).contiguous()),
                   minimum, threads=threads)

    @classmethod
    def pack(cls, w: torch.Tensor, fmt: str, tier, name: str, threads: int | None = None) -> "TierMatrix":
        if fmt not in TIER_FORMATS:
            raise TandemError(f"unknown tier format {fmt!r} (choose from {', '.join(TIER_FORMATS)})")
        w = w.detach().float()  # [R, C]
        rows, cols = w.shape
        threads = tier_threads(tier) if threads is None else threads
        if fmt == "fp32":
            return cls(fmt, rows, cols, tier.allocate(name, w.contiguous()), threads=threads)
        if fmt == "fp16":
            return cls(fmt, rows, cols, tier.allocate(name, w.half().contiguous()), threads=threads)
        blocks = _pad_cols(w).reshape(rows, -1, BLOCK)  # [R, C/32, 32]
        amax = blocks.abs().amax(dim=-1)  # [R, C/32]
        if fmt == "q8":
            scale = (amax / 127.0).half()
            inv = torch.where(scale.float() > 0, 1.0 / scale.float(), torch.zeros_like(amax))
            codes = torch.clamp(torch.round(blocks * inv[..., None]), -127, 127).to(torch.int8)
            data = codes.reshape(rows, -1)  # [R, C_pad]
        elif fmt == "q4_1":
            lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)  # [R, C/32]
            minimum, scale = lo.half(), ((hi - lo) / 15.0).half()
            inv = torch.where(scale.float() > 0, 1.0 / scale.float(), torch.zeros_like(amax))
            codes = torch.clamp(torch.round((blocks - minimum.float()[..., None]) * inv[..., None]), 0, 15).to(torch.uint8)
            data = (codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)).reshape(rows, -1)  # [R, C_pad/2]
            return cls(fmt, rows, cols, tier.allocate(name, data.contiguous()),
                       tier.allocate(name + ".scale", scale.contiguous()), tier.allocate(name + ".min", minimum.contiguous()),
                       threads=threads)
        else:
            scale = (amax / 7.0).half()
            inv = torch.where(scale.float() > 0, 1.0 / scale.float(), torch.zeros_like(amax))
            codes = (torch.clamp(torch.round(blocks * inv[..., None]), -8, 7) + 8).to(torch.uint8)  # [R, C/32, 32]
            data = (codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)).reshape(rows, -1)  # [R, C_pad/2]
        return cls(fmt, rows, cols, tier.allocate(name, data.contiguous()),
                   tier.allocate(name + ".scale", scale.contiguous()), threads=threads)

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scale, self.minimum)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]`` on the tier's device."""
        return dequantize_blocks(self.fmt, self.rows, self.cols, self.data, self.scale, self.minimum)

    def kernel_weight(self):
        """The same codes as an ``online.kernels.quantize`` weight (CPU tier), or None where the kernels do not
        read this layout (padded rows, fp16 rows not a multiple of 8 wide). Codes are shared, not copied; the
        f16 block scales are widened to float32 (exactly) until the kernels read f16 scales."""
        from online.kernels.quantize import BlockInt8Weight, Fp16Weight, Fp32Weight, Int4Weight
        if self.data.device.type != "cpu" or self.cols % BLOCK:
            return None
        data = self.data.numpy()
        if self.fmt == "fp32":
            return Fp32Weight(data)
        if self.fmt == "fp16":
            return Fp16Weight(data)
        scale = np.ascontiguousarray(self.scale.numpy().astype(np.float32))  # [R, C/32]
        if self.fmt == "q8":
            return BlockInt8Weight(q=data, scale=scale)
        minimum = (-8.0 * scale).astype(np.float32) if self.minimum is None else self.minimum.numpy().astype(np.float32)
        return Int4Weight(packed=data, scale=scale, minimum=np.ascontiguousarray(minimum), group_size=BLOCK)

    def kernel(self):
        """``online.kernels.QuantizedLinear`` over ``kernel_weight`` (built once), or None."""
        if self._kernel is None:
            from online.kernels.ffn import QuantizedLinear
            weight = self.kernel_weight()
            self._kernel = False if weight is None else QuantizedLinear(weight, threads=self.threads)
        return self._kernel or None

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, cols]``: rows ``ids`` only (an embedding lookup)."""
        if self.fmt not in ("fp32", "fp16") and self.kernel() is not None:
            return self.kernel().embed(ids)
        data = self.data[ids]
        if self.fmt in ("fp32", "fp16"):
            return data.float()
        sub = TierMatrix(self.fmt, ids.numel(), self.cols, data, self.scale[ids],
                         None if self.minimum is None else self.minimum[ids])
        return sub.dequantize()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[T, cols]`` -> ``[T, rows]``: the CPU kernels on a CPU tier, else dequantize and one matmul."""
        kernel = self.kernel()
        if kernel is not None and x.dtype == torch.float32:
            y = kernel.forward(x.contiguous())
            return y if bias is None else y + bias
        return F.linear(x, self.dequantize(), bias)


def dequantize_blocks(fmt: str, rows: int, cols: int, data: torch.Tensor, scale: torch.Tensor | None,
                      minimum: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[rows, cols]`` of a tier matrix's tensors (fp32/fp16 values, or Q8_0 / Q4_0 / Q4_1 codes and
    their f16 block scales and minima, GGUF's nibble order)."""
    if fmt in ("fp32", "fp16"):
        return data.float()
    if fmt == "q8":
        w = data.float().reshape(rows, -1, BLOCK) * scale.float()[..., None]
    else:
        packed = data.reshape(rows, -1, BLOCK // 2)  # [R, C/32, 16]
        codes = torch.cat([packed & 0xF, packed >> 4], dim=-1).float()  # [R, C/32, 32]
        if minimum is None:
            w = (codes - 8.0) * scale.float()[..., None]
        else:
            w = codes * scale.float()[..., None] + minimum.float()[..., None]
    return w.reshape(rows, -1)[:, :cols]


def tier_threads(tier) -> int:
    """CPU-kernel threads of a tier (its ``threads``; torch's count when it has none)."""
    return max(1, int(getattr(tier, "threads", 0) or torch.get_num_threads()))
