"""OPT and MoE layers for the fused decode step: their TdmLayer / TdmModel fields (decode.c, arch.h, moe.h).

OPT: LayerNorm with bias (``norm_kind`` 1 and the norms' biases), learned positions (the table from OPT's
offset on), the up projection's bias; the rest (q/k/v/o and down biases, the non-gated ReLU FFN with its
exact-zero and predictor sparsity) is the dense layers' code.

MoE (Mixtral, Qwen2-MoE): the float router, top-k and softmax, every selected expert through the dense
layers' row code, the shared expert and its sigmoid gate, all in C (moe.h). The experts come from the
executor's ExpertRuntime (its packed host buffers: int8 / int4 rows read in place, fp32 experts' down
projection transposed once) or, without one, from its float MoE weights (float32 rows, down transposed
once). All experts are read from RAM: an expert cache on a CUDA tier, or a shared expert placed on the
tier, keeps the module path (``FusedDecodeUnavailable``).

Example::

    check_moe(model, executor, FusedDecodeUnavailable)  # raises it with the reason
    ref = build_moe(model.cfg, executor, layer=0)      # MoeRef: .desc (TdmMoe), .keep, .neurons
    layer.moe = ctypes.pointer(ref.desc)
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from tandem.core.errors import TandemError

from ..kernels.native.structs import TdmExpert, TdmMoe, addr, describe
from ..kernels.quantize import Fp32Weight


def _f32(t) -> np.ndarray:
    """A float32 C-contiguous numpy copy-or-view of a tensor / array."""
    a = t.detach().float().contiguous().numpy() if hasattr(t, "detach") else np.asarray(t, dtype=np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


def _opt(a) -> np.ndarray | None:
    if a is None:
        return None
    a = _f32(a)
    return a if a.size else None


@dataclass
class MoeRef:
    """A TdmMoe and everything it points into; ``neurons``: FFN neurons per token (top_k experts + shared)."""
    desc: TdmMoe
    keep: list
    neurons: int


def check_moe(model, executor, unavailable) -> None:
    """Raise ``unavailable`` (an exception class) for MoE layers the fused step cannot read from RAM."""
    cfg = model.cfg
    runtime = getattr(executor, "experts", None)
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        if runtime is None:
            if i not in getattr(executor, "float_moe", {}):
                raise unavailable(f"no fused decode: MoE layer {i} has no experts in RAM")
            continue
        if runtime.tier.is_cuda:
            raise unavailable("no fused decode: the MoE expert cache is on a GPU tier")
        if runtime.caches[i].num_slots or runtime.caches[i].pinned:  # the step reads every expert from RAM
            raise unavailable(f"no fused decode: layer {i}'s expert cache decides per token where its experts run")
        if i in runtime.tier_shared:
            raise unavailable(f"no fused decode: layer {i}'s shared expert is on the GPU tier")


def layer_arrays(block, split) -> dict:
    """TdmLayer's OPT arrays: the input norms' biases, the up projection's bias (None: absent)."""
    out = dict(attn_norm_bias=_opt(getattr(block.input_layernorm, "bias", None)),
               ffn_norm_bias=_opt(getattr(block.post_attention_layernorm, "bias", None)))
    if split is not None and split.cpu is not None:
        out["up_bias"] = _opt(split.cpu.up_bias)
    return out


def model_fields(model) -> tuple[dict, list, int | None]:
    """(TdmModel's OPT fields, arrays to keep alive, position rows or None for rope models)."""
    cfg = model.cfg
    fields, keep, positions = {"norm_kind": 1 if cfg.norm == "layer" else 0}, [], None
    final_bias = _opt(getattr(model.norm, "bias", None))
    if final_bias is not None:
        fields["final_norm_bias"] = addr(final_bias)
        keep.append(final_bias)
    if cfg.position == "learned":
        table = _f32(model.embed_positions.weight)[cfg.position_offset:]  # [positions, d]: row p is position p
        table = np.ascontiguousarray(table)
        fields["pos_embed"] = addr(table)
        keep.append(table)
        positions = table.shape[0]
    return fields, keep, positions


def _expert(weights: dict, keep: list) -> TdmExpert:
    """weights: gate / up and down_t (rows = neurons) or down ([d, n_ff], read dense: moe.h), packed or
    Fp32Weight, and up_bias / down_bias arrays (or None)."""
    refs = {k: describe(weights[k], dot_input=k != "down_t") for k in ("gate", "up", "down_t", "down")
            if weights.get(k) is not None}
    biases = {k: _opt(weights.get(k)) for k in ("up_bias", "down_bias")}
    keep += list(refs.values()) + [b for b in biases.values() if b is not None]
    return TdmExpert(n_ff=refs["up"].desc.rows, **{k: r.desc for k, r in refs.items()},
                     **{k: addr(b) for k, b in biases.items()})


def _block_expert(q) -> dict:
    """A QuantizedFFN in a GGUF file's blocks (online/experts/block_experts.py): its rows and dense down."""
    return dict(gate=q.gate, up=q.up, down=q.down, up_bias=None, down_bias=None)


def _float_expert(w) -> dict:
    """An FFNWeights (float) as float32 rows, the down projection transposed (one copy)."""
    if w.gate is None or w.gate_bias is not None:
        raise TandemError("experts without a gate, or with a gate bias")
    return dict(gate=Fp32Weight(_f32(w.gate)), up=Fp32Weight(_f32(w.up)), down_t=Fp32Weight(_f32(w.down.t())),
                up_bias=w.up_bias, down_bias=w.down_bias)


def _packed_expert(p) -> dict:
    """A PackedExpert (online.experts.packing): its QuantizedFFN's rows in place, or its fp32 views."""
    if p.qffn is None:
        v = p.layout.views(p.host)
        return dict(gate=Fp32Weight(_f32(v["gate.w"])), up=Fp32Weight(_f32(v["up.w"])),
                    down_t=Fp32Weight(_f32(v["down.w"].t())), up_bias=v.get("up_bias"), down_bias=v.get("down_bias"))
    q = p.qffn
    if q.gate is None or q.gate_bias.size:
        raise TandemError("experts without a gate, or with a gate bias")
    return dict(gate=q.gate, up=q.up, down_t=q.down_t, down=q.down, up_bias=q.up_bias, down_bias=q.down_bias)


def count_experts(executor, n_tokens: int) -> None:
    """The experts a fused step ran on the CPU, in the executor's expert runtime (its stats), if it has one."""
    runtime = getattr(executor, "experts", None)
    if runtime is not None:
        runtime.count_fused(n_tokens)


def build_moe(cfg, executor, layer: int) -> MoeRef:
    """The TdmMoe of MoE layer ``layer`` (check_moe first)."""
    runtime, keep = getattr(executor, "experts", None), []
    blocks = getattr(executor, "block_moe", {}).get(layer) if runtime is None else None
    if blocks is not None:  # the file's blocks (or the engine's format), read in place
        router, gate_vector = blocks.weights.router, blocks.shared_gate
        experts = [_block_expert(q) for q in blocks.experts]
        shared_weights = None if blocks.shared is None else _block_expert(blocks.shared)
    else:
        moe = runtime.moe[layer] if runtime is not None else executor.float_moe[layer]
        router, gate_vector = moe.router, moe.shared_expert_gate
        experts = ([_packed_expert(p) for p in runtime.packed[layer]] if runtime is not None
                   else [_float_expert(w) for w in moe.experts])
        if runtime is not None and layer in runtime.cpu_shared:  # packed beside the experts
            shared_weights = _block_expert(runtime.cpu_shared[layer])
        else:
            shared_weights = None if moe.shared_expert is None else _float_expert(moe.shared_expert)
    table = (TdmExpert * len(experts))(*[_expert(e, keep) for e in experts])
    router = _f32(router)  # [E, d]
    shared = gate = None
    neurons = cfg.num_experts_per_tok * table[0].n_ff
    if shared_weights is not None:
        shared = _expert(shared_weights, keep)
        gate = _f32(gate_vector).reshape(-1)  # [d]
        neurons += shared.n_ff
        keep += [shared, gate]
    sparse = executor.settings.sparse and cfg.ffn_is_relu_sparse
    desc = TdmMoe(n_experts=len(experts), top_k=cfg.num_experts_per_tok, norm_topk=int(cfg.norm_topk_prob),
                  router=addr(router), experts=table, shared=None if shared is None else ctypes.pointer(shared),
                  shared_gate=addr(gate), threshold=0.0 if sparse else -1.0)
    keep += [table, router]
    return MoeRef(desc, keep, neurons)


def expert_width(ref: MoeRef) -> int:
    """The widest FFN of a MoE layer (the step's [n_ff] scratch must hold it)."""
    widths = [ref.desc.experts[i].n_ff for i in range(ref.desc.n_experts)]
    if ref.desc.shared:
        widths.append(ref.desc.shared.contents.n_ff)
    return max(widths)
