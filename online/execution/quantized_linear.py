"""Swap-in quantized linear layers for attention projections (gpt-fast style).

Example::

    quantize_attention(model, fmt="int8", threads=2)   # q/k/v/o become QuantizedLinearModule
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tandem.core.errors import TandemError

from ..kernels.ffn import QuantizedLinear
from ..kernels.quantize import concat_rows

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class QuantizedLinearModule(nn.Module):
    def __init__(self, linear: QuantizedLinear) -> None:
        super().__init__()
        self.linear = linear
        self.out_features, self.in_features = linear.out_features, linear.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear.forward(x)

    @property
    def nbytes(self) -> int:
        return self.linear.nbytes


class SplitQKVModule(nn.Module):
    """q, k and v kept apart where their GGUF block kinds cannot stack exactly (Q4_K_M's Q4_K q/k with a
    Q6_K v): the three outputs concatenated, as one stacked projection would give them. The fused step
    describes each (TdmLayer qkv = q, k, v)."""

    def __init__(self, parts: list) -> None:  # [q, k, v] QuantizedLinear
        super().__init__()
        self.parts = list(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.forward(x) for p in self.parts], dim=-1)  # [..., q + 2 kv]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def stacked_bias(self) -> np.ndarray | None:
        """[q + 2 kv] the three biases side by side (zeros where one has none); None: no bias at all."""
        if not any(p.bias.size for p in self.parts):
            return None
        return np.concatenate([p.bias if p.bias.size else np.zeros(p.out_features, np.float32) for p in self.parts])


def quantize_attention(model, fmt: str, threads: int, raw: dict | None = None) -> int:
    """Replace every attention projection by a packed one; returns the packed bytes.

    GGUF raw blocks are used as they are when their type is the requested family
    (Q8_0 for int8, Q4_0/Q4_1 for int4), so no float round trip happens.
    """
    total = 0
    raw = raw or {}
    for i, block in enumerate(model.layers):
        attn = block.self_attn
        if getattr(attn, "on_tier", False):
            continue  # the plan put this layer's attention on the GPU tier (tier_units.TierAttention)
        packed = {}
        for name in ATTENTION_PROJECTIONS:
            lin: nn.Linear = getattr(attn, name)
            blocks = raw.get(f"model.layers.{i}.self_attn.{name}.weight")
            if blocks is not None and _matches(blocks.qtype, fmt):
                packed[name] = QuantizedLinear.from_gguf(blocks, bias=_np(lin.bias), threads=threads)
            else:
                packed[name] = QuantizedLinear.from_float(lin.weight, fmt=fmt, bias=_np(lin.bias), threads=threads)
        attn.o_proj = QuantizedLinearModule(packed["o_proj"])
        qkv = [packed[n] for n in ("q_proj", "k_proj", "v_proj")]
        try:  # one fused projection (one kernel call) when the three share a format
            weight = _concat_qkv([p.weight for p in qkv])
            bias = None
            if any(p.bias.size for p in qkv):
                bias = np.concatenate([p.bias if p.bias.size else np.zeros(p.out_features, np.float32) for p in qkv])
            attn.qkv_proj = QuantizedLinearModule(QuantizedLinear(weight, bias=bias, threads=threads))
            del attn.q_proj, attn.k_proj, attn.v_proj
        except TandemError:  # block kinds that cannot stack exactly: three weights, one module
            attn.qkv_proj = SplitQKVModule(qkv)
            del attn.q_proj, attn.k_proj, attn.v_proj
        total += sum(p.nbytes for p in packed.values())
    return total


def _np(bias):
    return None if bias is None else bias.detach().float().numpy()


# GGUF block types packed as they are (no float round trip) for each requested format. k-quant files
# mix precisions per tensor on purpose: their Q4_K / Q5_0 / Q5_K / Q6_K blocks are read in place by
# either format (exact, and fewer bytes than int8); Q4_0 / Q4_1 tensors of int8 plans are re-quantized.
IN_PLACE_GGUF_TYPES = ("Q4_K", "Q5_0", "Q5_K", "Q6_K")
DENSE_DOWN_EXTRA = ("Q4_0", "Q4_1")  # read dense in place too (f16-scaled int4, native/blocks_dot.h)
EXACT_GGUF_TYPES = {"int8": ("Q8_0", "IQ4_NL", *IN_PLACE_GGUF_TYPES), "int4": ("Q4_0", "Q4_1", *IN_PLACE_GGUF_TYPES)}


def _matches(qtype: str, fmt: str) -> bool:
    return qtype in EXACT_GGUF_TYPES.get(fmt, ())


def _concat_qkv(weights: list):
    """q, k, v stacked; where their formats differ (Gemma's Q5_0 q/k with a Q8_0 v), Q5_0 blocks widened
    to int8 codes with their f16 scales (exact) so the three still stack."""
    from online.kernels.superblocks import GGUFBlockWeight
    from online.kernels.quantize import int8_from_q8_0

    try:
        return concat_rows(weights)
    except TandemError:
        if not any(isinstance(w, GGUFBlockWeight) and w.qtype == "Q5_0" for w in weights):
            raise
    widened = []
    for w in weights:
        if isinstance(w, GGUFBlockWeight) and w.qtype == "Q5_0":
            q, d = w.int8_codes()
            w = int8_from_q8_0(d, q)
        widened.append(w)
    return concat_rows(widened)


# bytes per weight of the sparse down rows (ExecutionSettings.down_format) and the share of them a
# token is assumed to read where activations are not exactly zero (SiLU / GELU magnitude thresholds
# keep most neurons: Gemma 3's plan ~79%); ReLU-family layers read the share their predictor marks
_DOWN_ROW_BYTES = {"fp16": 2.0, "fp32": 4.0, "int8b": 34 / 32, "int8": 1.0, "int4": 0.625}
_DENSE_SHARE_BOUND = 0.5


def dense_down_wanted(act: str, down_raw, down_format: str, active_share: float | None = None) -> bool:
    """Read the down projection dense in its GGUF blocks (in place) rather than as sparse rows when it
    reads fewer bytes: blocks <= 0.5 x the rows' bytes for non-ReLU layers; for ReLU-family layers, blocks
    <= the rows of the neurons their predictor marks active (``active_share``, e.g. 0.55 at 50% sparsity:
    0.55 x 8.4 MB of fp16 rows against 2.4 MB of Q4_0 blocks on a 1024 x 4096 down). Without a predictor
    a ReLU layer keeps the sparse rows."""
    if down_raw.qtype not in IN_PLACE_GGUF_TYPES + DENSE_DOWN_EXTRA:
        return False
    rows, cols = down_raw.shape
    if cols % 32:
        return False
    dense = np.asarray(down_raw.data).nbytes
    sparse = rows * cols * _DOWN_ROW_BYTES.get(down_format, 2.0)
    if act in ("relu", "fatrelu", "drelu"):
        return active_share is not None and dense <= active_share * sparse
    return dense <= _DENSE_SHARE_BOUND * sparse


def predicted_active_share(predictor) -> float | None:
    """The share of a layer's neurons its predictor marked active on the profile's held-out tokens
    (train-predictors' ``predicted_sparsity``), or None (no predictor, a tier predictor, no record)."""
    try:
        sparsity = predictor.pset.entry(predictor.layer).stats.get("predicted_sparsity")
    except AttributeError:
        return None
    return None if sparsity is None else min(max(1.0 - float(sparsity), 0.0), 1.0)


def describe_qkv(qkv_proj, layer: int) -> tuple[dict, np.ndarray | None]:
    """The fused step's q/k/v descriptors (TdmLayer qkv, and k / v where the three are kept apart) and
    the stacked bias [q + 2 kv] (None: none)."""
    from ..kernels.native.structs import describe

    if isinstance(qkv_proj, SplitQKVModule):
        refs = {}
        for field, name, part in zip(("qkv", "k", "v"), ("q_proj", "k_proj", "v_proj"), qkv_proj.parts):
            try:
                refs[field] = describe(part.weight)
            except TandemError as exc:
                raise TandemError(f"layer {layer} {name} ({_kind_name(part.weight)}): {exc}") from None
        return refs, qkv_proj.stacked_bias()
    bias = np.asarray(qkv_proj.linear.bias, dtype=np.float32)
    return dict(qkv=describe(qkv_proj.linear.weight)), bias if bias.size else None


def _kind_name(weight) -> str:
    return getattr(weight, "qtype", None) or type(weight).__name__
