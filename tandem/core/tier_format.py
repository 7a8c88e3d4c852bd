"""Weights on the GPU tier in the plan's format, with dequantizing matmuls in torch ops (CPU and CUDA).

Formats (bytes per weight as the planner counts them, ``placement.settings.WEIGHT_FORMATS``):

- ``fp32`` (4), ``fp16`` (2): the rows as they are.
- ``q8`` (1.0625): GGUF Q8_0 layout, int8 codes ``[R, C]`` + float16 scale per 32 inputs ``[R, C/32]``.
- ``q4_1`` (0.625): GGUF Q4_1 layout, as ``q4`` plus a float16 block minimum ``[R, C/32]``:
  w = scale * q + minimum (the format of Q4_1 checkpoints, whose blocks re-encode almost exactly).
- ``q4`` (0.5625): GGUF Q4_0 layout, codes 0..15 packed two per byte ``[R, C/2]`` (inside block g,
  byte j holds element 32g + j in its low nibble and 32g + 16 + j in its high nibble, as GGUF and the
  CPU tier's ``Int4Weight`` order them) + float16 scale ``[R, C/32]``; w = scale * (q - 8).

Rows whose width is not a multiple of 32 are zero-padded to one (the padding is charged too).

Example::

    m = TierMatrix.pack(w, "q4", tier, "layers.3.hot_up")    # w [R, C] float32, bytes charged to the tier
    y = m.linear(x)                                          # x [T, C] on the tier -> [T, R]
    m.nbytes                                                 # R * C * 0.5625
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.core.errors import TandemError

TIER_FORMATS = {"fp32": 4.0, "fp16": 2.0, "q8": 1.0625, "q4_1": 0.625, "q4": 0.5625}
BLOCK = 32


def tier_format_for(bytes_per_weight: float) -> str:
    """The densest tier format that still holds ``bytes_per_weight`` (the plan's) or more bytes of detail.

    >>> tier_format_for(0.5625), tier_format_for(0.625), tier_format_for(2.0), tier_format_for(1.5)
    ('q4', 'q4_1', 'fp16', 'q8')
    """
    fitting = [(bpw, name) for name, bpw in TIER_FORMATS.items() if bpw <= bytes_per_weight + 1e-9]
    if not fitting:
        return "q4"
    return max(fitting)[1]


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

    @classmethod
    def pack(cls, w: torch.Tensor, fmt: str, tier, name: str) -> "TierMatrix":
        if fmt not in TIER_FORMATS:
            raise TandemError(f"unknown tier format {fmt!r} (choose from {', '.join(TIER_FORMATS)})")
        w = w.detach().float()  # [R, C]
        rows, cols = w.shape
        if fmt == "fp32":
            return cls(fmt, rows, cols, tier.allocate(name, w.contiguous()))
        if fmt == "fp16":
            return cls(fmt, rows, cols, tier.allocate(name, w.half().contiguous()))
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
                       tier.allocate(name + ".scale", scale.contiguous()), tier.allocate(name + ".min", minimum.contiguous()))
        else:
            scale = (amax / 7.0).half()
            inv = torch.where(scale.float() > 0, 1.0 / scale.float(), torch.zeros_like(amax))
            codes = (torch.clamp(torch.round(blocks * inv[..., None]), -8, 7) + 8).to(torch.uint8)  # [R, C/32, 32]
            data = (codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)).reshape(rows, -1)  # [R, C_pad/2]
        return cls(fmt, rows, cols, tier.allocate(name, data.contiguous()),
                   tier.allocate(name + ".scale", scale.contiguous()))

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scale, self.minimum)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]`` on the tier's device."""
        if self.fmt in ("fp32", "fp16"):
            return self.data.float()
        if self.fmt == "q8":
            w = self.data.float().reshape(self.rows, -1, BLOCK) * self.scale.float()[..., None]
        else:
            packed = self.data.reshape(self.rows, -1, BLOCK // 2)  # [R, C/32, 16]
            codes = torch.cat([packed & 0xF, packed >> 4], dim=-1).float()  # [R, C/32, 32]
            if self.minimum is None:
                w = (codes - 8.0) * self.scale.float()[..., None]
            else:
                w = codes * self.scale.float()[..., None] + self.minimum.float()[..., None]
        return w.reshape(self.rows, -1)[:, :self.cols]

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, cols]``: rows ``ids`` only (an embedding lookup)."""
        data = self.data[ids]
        if self.fmt in ("fp32", "fp16"):
            return data.float()
        sub = TierMatrix(self.fmt, ids.numel(), self.cols, data, self.scale[ids],
                         None if self.minimum is None else self.minimum[ids])
        return sub.dequantize()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[T, cols]`` -> ``[T, rows]`` (dequantize, then one matmul)."""
        return F.linear(x, self.dequantize(), bias)


def expert_format_for(bytes_per_weight: float) -> str:
    """The expert packing (``online.experts.packing``) a plan's bytes per weight runs experts in.

    >>> expert_format_for(4.0), expert_format_for(2.0), expert_format_for(0.5625)
    ('fp32', 'int8', 'int4')
    """
    if bytes_per_weight >= TIER_FORMATS["fp32"]:
        return "fp32"
    return "int8" if bytes_per_weight >= TIER_FORMATS["q8"] else "int4"


def expert_layout_bytes(hidden_size: int, n_ff: int, gated: bool, fmt: str, bias: bool = False,
                        align_bytes: int = 64, group_size: int = 32) -> int:
    """Bytes of one packed expert buffer, from shapes alone (mirrors ``online.experts.packing.pack_expert``).

    >>> expert_layout_bytes(64, 48, True, "int4")
    7872
    """
    def aligned(n: int) -> int:
        return (n + align_bytes - 1) // align_bytes * align_bytes
    n_mats = 3 if gated else 2
    if fmt == "fp32":
        fields = [4 * n_ff * hidden_size] * n_mats
    else:
        if fmt == "int8":
            first = [n_ff * hidden_size, 4 * n_ff]  # codes, per-row scale
        else:
            groups = n_ff * (hidden_size // group_size)
            first = [n_ff * hidden_size // 2, 4 * groups, 4 * groups]  # nibbles, scale, minimum
        fields = first * (n_mats - 1) + [n_ff * hidden_size, 4 * n_ff]  # down_t is always int8 rows
    if bias:
        fields += [4 * n_ff] * (n_mats - 1) + [4 * hidden_size]
    return sum(aligned(n) for n in fields)
