"""One contiguous buffer per expert, so that moving an expert to the GPU tier is ONE copy.

An expert's weights (float32, or the packed int8 / int4 formats of ``online.kernels``) are laid out
field after field, each 64-byte aligned, in a single uint8 buffer. The host copy is the only copy
of the expert on the host: the CPU kernels (``QuantizedFFN``) read views into it, and the GPU tier
gets the same bytes, so an expert gives the same result (to float rounding) wherever it runs.

Example::

    packed = pack_expert(cfg, ffn_weights, fmt="int8", threads=2, pin=False)
    packed.host.shape               # [nbytes] uint8
    y_cpu = packed.cpu_forward(x)   # [T, d] on the host
    slot = packed.host.clone()      # what the cache holds on the tier
    y_tier = tier_forward(cfg, packed.layout, slot, x)

An int4 expert of a GGUF file with Q4_0 / Q4_1 blocks, or an int8 one with Q8_0 blocks (``expert_blocks``), keeps
the file's values at the file's bytes: gate / up and the down projection ``[d, n_ff]`` (``down``: its blocks run
along n_ff, one dense product) as those blocks with their f16 scales (and Q4_1's f16 minimums). Re-quantizing them
(gate / up to int4 codes again, the down to per-row int8) moved the output wherever an expert cache was on
(``--expert-slots``, MoE plans).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.core.errors import TandemError
from tandem.core.config import ModelConfig
from tandem.core.ffn.activations import gated_hidden, activate
from tandem.core.ffn.dense import ffn_down, ffn_hidden
from tandem.core.ffn.weights import FFNWeights
from ..kernels.ffn import QuantizedFFN
from tandem.core.tier_format import _RAW_AS_IS, EXPERT_FILE_BLOCKS
from .block_experts import expert_blocks_of
from ..kernels.quantize import BlockInt8Weight, Fp32Weight, Int4Weight, Int8Weight, quantize, weight_from_gguf

ALIGN_BYTES = 64
EXPERT_FORMATS = ("fp32", "int8", "int4")
_NP_TO_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, np.dtype(np.int8): torch.int8,
                np.dtype(np.uint8): torch.uint8}  # float16: int4 scales (quantize.py keeps them as GGUF does)


@dataclass(frozen=True)
class Field:
    name: str  # e.g. "up.q", "down_t.scale"
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into the buffer

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ExpertLayout:
    """Where each tensor of an expert lives in its buffer."""
    fmt: str
    fields: tuple[Field, ...]
    nbytes: int
    gated: bool
    group_size: int = 32

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views into ``buffer`` (uint8 [nbytes], any device); no copies."""
        return {f.name: buffer[f.offset:f.offset + f.nbytes].view(f.dtype).view(f.shape) for f in self.fields}


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _weight_arrays(prefix: str, w, as_file: bool = False) -> list[tuple[str, np.ndarray]]:
    """A weight's fields; ``as_file``: a GGUF file's blocks at its own bytes (f16 scales, Q4_1's minimum)."""
    if isinstance(w, Fp32Weight):
        return [(f"{prefix}.w", w.w)]
    if isinstance(w, Int8Weight):
        return [(f"{prefix}.q", w.q), (f"{prefix}.scale", w.scale)]
    if isinstance(w, BlockInt8Weight):  # Q8_0: one f16 scale per 32 inputs
        return [(f"{prefix}.q", w.q), (f"{prefix}.bscale", w.scale.astype(np.float16))]
    if isinstance(w, Int4Weight) and as_file:  # Q4_0: codes, f16 scales; Q4_1: and f16 minimums
        minimum = [] if w.minimum is None else [(f"{prefix}.minimum", w.minimum.astype(np.float16))]
        return [(f"{prefix}.packed", w.packed), (f"{prefix}.scale", w.scale.astype(np.float16))] + minimum
    if isinstance(w, Int4Weight):  # float32 scale and minimum: the slot size the planner counts from shapes
        scale = w.scale.astype(np.float32)  # (quantize_int4 keeps f16 only where every value is normal)
        minimum = -8.0 * scale if w.minimum is None else w.minimum.astype(np.float32)
        return [(f"{prefix}.packed", w.packed), (f"{prefix}.scale", scale), (f"{prefix}.minimum", minimum)]
    raise TandemError(f"expert weights of type {type(w).__name__} cannot be packed")


def _rebuild(prefix: str, w, views: dict[str, np.ndarray]):
    if isinstance(w, Fp32Weight):
        return Fp32Weight(views[f"{prefix}.w"])
    if isinstance(w, Int8Weight):
        return Int8Weight(views[f"{prefix}.q"], views[f"{prefix}.scale"])
    if isinstance(w, BlockInt8Weight):
        return BlockInt8Weight(views[f"{prefix}.q"], views[f"{prefix}.bscale"])
    return Int4Weight(views[f"{prefix}.packed"], views[f"{prefix}.scale"], views.get(f"{prefix}.minimum"), w.group_size)


@dataclass
class PackedExpert:
    """An expert's host buffer, its layout and a CPU compute path over that same buffer."""
    layout: ExpertLayout
    host: torch.Tensor  # [nbytes] uint8 (pinned when the tier is CUDA)
    qffn: QuantizedFFN | None  # int8 / int4 CPU kernels (None for fp32: torch float on views)
    cfg: ModelConfig

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def cpu_forward(self, x: torch.Tensor) -> torch.Tensor:
        """y [T, d] for x [T, d] (float32, host), computed on the CPU where the expert lives."""
        if self.qffn is not None:
            return self.qffn.forward_dense(x.contiguous())
        return _float_forward(self.cfg, self.layout, self.layout.views(self.host), x)


def _float_forward(cfg: ModelConfig, layout: ExpertLayout, v: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w = FFNWeights(up=v["up.w"], down=v["down.w"], gate=v.get("gate.w"), up_bias=v.get("up_bias"),
                   gate_bias=v.get("gate_bias"), down_bias=v.get("down_bias"))
    return ffn_down(w, ffn_hidden(cfg, w, x))  # [T, d], exactly DenseExecutor's arithmetic


def dense_down_fits(fmt: str, n_ff: int, group_size: int = 32) -> bool:
    """Whether a re-quantized int4 / int8 expert keeps its down whole (the row kernels read inputs in 32-wide
    blocks: they must divide n_ff), as block_experts does; else the down is int8 rows transposed."""
    return fmt in ("int4", "int8") and n_ff % group_size == 0


def expert_blocks(raw: dict | None, layer: int, expert: int, fmt: str) -> dict | None:
    """The GGUF tensors {"up", "gate", "down"} of one expert in a checkpoint's ``raw``, where all three are blocks
    a ``fmt`` buffer keeps (int4: Q4_0 / Q4_1, int8: Q8_0; else None: the expert is quantized from float)."""
    found = expert_blocks_of(raw, layer, expert)
    kinds = {t.qtype for t in found.values()} if found is not None else set()  # one for all three (the planner's role)
    return found if len(kinds) == 1 and kinds <= set(EXPERT_FILE_BLOCKS.get(fmt, ())) else None


def block_format(blocks: dict | None) -> str | None:
    """The tier format ("q4", "q4_1", "q8") of ``expert_blocks``' kind, the layout expert_layout_bytes counts."""
    return None if blocks is None else _RAW_AS_IS[blocks["up"].qtype][0]


def _dequantize(v: dict[str, torch.Tensor], prefix: str, group_size: int) -> torch.Tensor:
    if f"{prefix}.bscale" in v:  # Q8_0 blocks: a scale per 32 inputs
        return v[f"{prefix}.q"].float() * v[f"{prefix}.bscale"].float().repeat_interleave(32, dim=1)  # [out, in]
    if f"{prefix}.q" in v:
        return v[f"{prefix}.q"].float() * v[f"{prefix}.scale"][:, None]  # [out, in]
    packed = v[f"{prefix}.packed"]  # [out, in/2] uint8, nibble order of online.kernels.quantize
    rows, cols = packed.shape[0], packed.shape[1] * 2
    p = packed.view(rows, cols // group_size, group_size // 2)  # [out, groups, G/2]
    q = torch.cat([p & 15, p >> 4], dim=-1).float()  # [out, groups, G]
    scale = v[f"{prefix}.scale"].float()  # [out, groups] (f16 where the file's blocks are kept: exact)
    minimum = v[f"{prefix}.minimum"].float() if f"{prefix}.minimum" in v else -8.0 * scale  # Q4_0: -8 d
    return (q * scale[:, :, None] + minimum[:, :, None]).reshape(rows, cols)


def tier_forward(cfg: ModelConfig, layout: ExpertLayout, buffer: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y [T, d] for x [T, d] on ``buffer``'s device, reading the expert from ``buffer``."""
    v = layout.views(buffer)
    if layout.fmt == "fp32":
        return _float_forward(cfg, layout, v, x)
    up = F.linear(x, _dequantize(v, "up", layout.group_size), v.get("up_bias"))  # [T, F]
    if layout.gated:
        gate = F.linear(x, _dequantize(v, "gate", layout.group_size), v.get("gate_bias"))  # [T, F]
        h = gated_hidden(cfg.hidden_act, gate, up, cfg.act_threshold)
    else:
        h = activate(cfg.hidden_act, up, cfg.act_threshold)
    if "down.packed" in v or "down.q" in v:  # the file's down blocks [d, n_ff]
        y = h @ _dequantize(v, "down", layout.group_size).T  # [T, d]
    else:
        y = h @ _dequantize(v, "down_t", layout.group_size)  # [T, d] (down stored transposed)
    return y + v["down_bias"] if "down_bias" in v else y


def pack_expert(cfg: ModelConfig, w: FFNWeights, fmt: str, threads: int = 2, pin: bool = False,
                blocks: dict | None = None) -> PackedExpert:
    """Quantize (unless fp32) and pack one expert into a single host buffer; with ``blocks`` (``expert_blocks``
    for this ``fmt``): the file's blocks as they are (module docstring)."""
    if fmt not in EXPERT_FORMATS:
        raise TandemError(f"unknown expert weight format {fmt!r} (choose from {', '.join(EXPERT_FORMATS)})")
    biases = [(n, getattr(w, n)) for n in ("up_bias", "gate_bias", "down_bias") if getattr(w, n) is not None]
    arrays: list[tuple[str, np.ndarray]] = []
    weights = {}
    if fmt == "fp32":
        for name in ("up", "gate", "down"):
            t = getattr(w, name)
            if t is not None:
                arrays.append((f"{name}.w", t.detach().float().contiguous().numpy()))
    elif blocks is not None and w.gate is not None:
        weights = {n: weight_from_gguf(t.data, t.qtype, t.shape) for n, t in blocks.items()}  # up, gate, down
        for name, qw in weights.items():
            arrays += _weight_arrays(name, qw, as_file=True)
    else:  # quantized from float: the down whole in the same format (as block_experts), else int8 rows
        weights = {"up": quantize(w.up.detach().float().numpy(), fmt)}
        if dense_down_fits(fmt, w.down.shape[1]):
            weights["down"] = quantize(w.down.detach().float().numpy(), fmt)  # [d, F]
        else:
            weights["down_t"] = quantize(np.ascontiguousarray(w.down.detach().float().numpy().T), "int8")  # [F, d]
        if w.gate is not None:
            weights["gate"] = quantize(w.gate.detach().float().numpy(), fmt)
        for name, qw in weights.items():
            arrays += _weight_arrays(name, qw)
    arrays += [(n, b.detach().float().contiguous().numpy()) for n, b in biases]
    fields, offset = [], 0
    for name, a in arrays:
        fields.append(Field(name, _NP_TO_TORCH[a.dtype], tuple(a.shape), offset))
        offset = _align(offset + a.nbytes)
    layout = ExpertLayout(fmt=fmt, fields=tuple(fields), nbytes=offset, gated=w.gate is not None)
    host = torch.zeros(offset, dtype=torch.uint8)
    if pin:
        host = host.pin_memory()
    for f, (_, a) in zip(fields, arrays):
        host[f.offset:f.offset + f.nbytes].copy_(torch.from_numpy(a.reshape(-1).view(np.uint8)))
    qffn = None
    if fmt != "fp32":
        views = {k: t.numpy() for k, t in layout.views(host).items()}
        rebuilt = {name: _rebuild(name, qw, views) for name, qw in weights.items()}
        bias = {n: views[n] for n, _ in biases}
        qffn = QuantizedFFN(rebuilt["up"], rebuilt.get("down_t"), rebuilt.get("gate"), act=cfg.hidden_act,
                            act_threshold=cfg.act_threshold, up_bias=bias.get("up_bias"),
                            gate_bias=bias.get("gate_bias"), down_bias=bias.get("down_bias"), threads=threads,
                            down=rebuilt.get("down"))  # the file's down: one dense product
    return PackedExpert(layout=layout, host=host, qffn=qffn, cfg=cfg)
