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
            weight = concat_rows([p.weight for p in qkv])
            bias = None
            if any(p.bias.size for p in qkv):
                bias = np.concatenate([p.bias if p.bias.size else np.zeros(p.out_features, np.float32) for p in qkv])
            attn.qkv_proj = QuantizedLinearModule(QuantizedLinear(weight, bias=bias, threads=threads))
            del attn.q_proj, attn.k_proj, attn.v_proj
        except TandemError:
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, QuantizedLinearModule(packed[name]))
        total += sum(p.nbytes for p in packed.values())
    return total


def _np(bias):
    return None if bias is None else bias.detach().float().numpy()


EXACT_GGUF_TYPES = {"int8": ("Q8_0", "Q5_0", "IQ4_NL"), "int4": ("Q4_0", "Q4_1", "Q4_K")}  # packed as is


def _matches(qtype: str, fmt: str) -> bool:
    return qtype in EXACT_GGUF_TYPES.get(fmt, ())
