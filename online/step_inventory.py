"""The packed tensors a built fused decode step reads, with their formats and bytes (placement.step_reads units).

Walks the step's C descriptors (TdmModel, TdmLayer, TdmPredictor): every weight it points at, named by its
kind as packed (GGUF blocks in place, re-packed int4 / int8, f16 / int8 sparse down rows), its bytes =
rows x row_bytes plus the scale and minimum arrays the descriptor points into.

Example::

    units = step_units(engine.compiled_decode, engine.config)
    bytes_by_kind(units)         # {"q4_1": 80_000_000, "q8_0": 28_000_000, ...}
"""
from __future__ import annotations

from dataclasses import replace

from placement.step_reads import StepUnit
from tandem.core.errors import TandemError

from .kernels.quantize import (KIND_F16, KIND_F32, KIND_I4, KIND_I4H, KIND_I4X8, KIND_I8, KIND_I8B, KIND_I8H,
                               KIND_I8X8, KIND_Q4K, KIND_Q50, KIND_Q5K, KIND_Q6K)

# kind -> format name; Q4_0 and Q4_1 share one kind (f16 scales, with / without a minimum): told apart below
KIND_NAMES = {KIND_F32: "f32", KIND_I8: "int8", KIND_I8B: "int8b", KIND_I4: "int4", KIND_F16: "f16",
              KIND_I4H: "q4_0", KIND_I8H: "q8_0", KIND_Q4K: "q4_k", KIND_Q50: "q5_0", KIND_Q6K: "q6_k", KIND_Q5K: "q5_k",
              KIND_I4X8: "q4_0", KIND_I8X8: "q8_0"}  # interleaved eight rows at a time (blocks_x8.h): GGUF's bytes
# bytes of one scale (and one minimum) entry per kind; GGUF blocks in place keep theirs inside the rows
_SCALE_BYTES = {KIND_I8: 4, KIND_I8B: 4, KIND_I4: 4, KIND_I4H: 2, KIND_I8H: 2, KIND_Q4K: 1}


def kind_name(w) -> str:
    if w.kind not in KIND_NAMES:
        raise TandemError(f"unknown packed weight kind {w.kind}")
    if w.kind == KIND_I4H and w.minimum:
        return "q4_1"
    if w.kind == KIND_I4X8 and w.row_bytes * 8 == 160 * (w.cols // 32):  # blocks with minimums
        return "q4_1"
    return KIND_NAMES[w.kind]


def weight_bytes(w) -> int:
    """Bytes of a TdmWeight: its rows plus the scale / minimum arrays it points into."""
    n = w.rows * w.row_bytes
    per = _SCALE_BYTES.get(w.kind, 0)
    if per and w.scale:
        n += w.rows * w.scale_stride * per
    if per and w.minimum:
        n += w.rows * w.scale_stride * per
    return int(n)


def _unit(role: str, layer: int, w) -> StepUnit:
    return StepUnit(role=role, layer=layer, kind=kind_name(w), packed_bytes=weight_bytes(w), rows=int(w.rows),
                    in_place=w.kind in (KIND_I4H, KIND_I8H))  # kinds the step interleaves elsewhere (blocks_x8.h)


def step_units(step, cfg) -> list[StepUnit]:
    """Every weight the step reads (MoE layers are refused: their reads follow the router)."""
    units = []
    for i in range(cfg.num_layers):
        layer = step._layers[i]
        if layer.moe:
            raise TandemError(f"layer {i} is a MoE layer: its reads are not modeled by format yet")
        units.append(_unit("qkv", i, layer.qkv))
        for role in ("k", "v"):  # kept apart when their block kinds differ from q's
            w = getattr(layer, role)
            if w.data:
                units.append(_unit(role, i, w))
        units.append(_unit("o", i, layer.o))
        paired = bool(layer.pred) and bool(layer.pred.contents.gate_up.data)  # predicted rows read from the pair
        if cfg.mlp_gated:
            units.append(replace(_unit("gate", i, layer.gate), paired=paired))
        units.append(replace(_unit("up", i, layer.up), paired=paired))
        units.append(_unit("down", i, layer.down) if layer.down.data else _unit("down_t", i, layer.down_t))
        if layer.pred:
            pred = layer.pred.contents
            units += [_unit("pred", i, pred.w1), _unit("pred", i, pred.w2)]
    units.append(_unit("head", -1, step._desc.head))
    units.append(StepUnit("embed_row", -1, "f32", 4 * cfg.hidden_size, rows=1))  # one float32 row of the table
    return units
