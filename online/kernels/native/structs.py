"""ctypes mirrors of decode.c's structs, and weight descriptors from the packed formats.

A descriptor holds raw addresses: whoever builds one keeps the numpy arrays alive (``WeightRef``).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from tandem.core.errors import TandemError

from ..quantize import KIND_F16, KIND_F32, KIND_I4, KIND_I4X8, KIND_I8X8, KIND_I8, KIND_I8B, KIND_I4H, KIND_I8H, KIND_Q4K, BlockInt8Weight, Fp16Weight, Fp32Weight, Int4Weight, Int8Weight
from ..superblocks import GGUFBlockWeight, Q4KWeight

_P = ctypes.c_void_p
_I = ctypes.c_int64


class TdmWeight(ctypes.Structure):
    _fields_ = [("kind", _I), ("group", _I), ("rows", _I), ("cols", _I), ("data", _P), ("row_bytes", _I),
                ("scale", _P), ("minimum", _P), ("scale_stride", _I)]


class TdmPredictor(ctypes.Structure):  # predict.h
    _fields_ = [("rank", _I), ("w1", TdmWeight), ("w2", TdmWeight), ("b1", _P), ("b2", _P),
                ("threshold", ctypes.c_double), ("z", _P), ("scratch", _P), ("predicted", _P), ("computed", _P),
                ("gate_up", TdmWeight)]  # data NULL: gate and up read apart (predict.h paired_rows)


class TdmExpert(ctypes.Structure):  # moe.h: one expert or the shared expert
    _fields_ = [("gate", TdmWeight), ("up", TdmWeight), ("down_t", TdmWeight), ("up_bias", _P), ("down_bias", _P),
                ("n_ff", _I), ("down", TdmWeight)]  # down: [d, n_ff] dense (data 0: the down_t rows)


class TdmMoe(ctypes.Structure):  # moe.h: a MoE layer
    _fields_ = [("n_experts", _I), ("top_k", _I), ("norm_topk", _I), ("router", _P),
                ("experts", ctypes.POINTER(TdmExpert)), ("shared", ctypes.POINTER(TdmExpert)), ("shared_gate", _P),
                ("threshold", ctypes.c_double)]


class TdmLayer(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("qkv_bias", _P), ("o_bias", _P), ("down_bias", _P),
                ("k_cache", _P), ("v_cache", _P), ("qkv", TdmWeight), ("o", TdmWeight), ("gate", TdmWeight),
                ("up", TdmWeight), ("down_t", TdmWeight), ("threshold", ctypes.c_double),
                ("pred", ctypes.POINTER(TdmPredictor)),
                # Qwen3 / Gemma 3 (None / 0: the Llama layout): q/k head norms, sandwich output norms,
                # the layer's own rope table and sliding window (> 0; else the model's)
                ("q_norm", _P), ("k_norm", _P), ("attn_out_norm", _P), ("ffn_out_norm", _P),
                ("rope_cos", _P), ("rope_sin", _P), ("window", _I),
                # OPT (None: absent): LayerNorm biases of the input norms, the up projection's bias; the
                # layer's FFN width (0: the model's); a MoE layer's router and experts (moe.h)
                ("attn_norm_bias", _P), ("ffn_norm_bias", _P), ("up_bias", _P), ("n_ff", _I),
                ("moe", ctypes.POINTER(TdmMoe)),
                ("down", TdmWeight),  # [d, n_ff] dense down (GGUF blocks in place); data None: the sparse down_t rows
                # q/k/v of different block kinds: qkv holds q only, k / v apart (k.data None: qkv stacks all three)
                ("k", TdmWeight), ("v", TdmWeight)]


class TdmModel(ctypes.Structure):
    _fields_ = [(name, _I) for name in ("n_layers", "d", "n_heads", "n_kv", "head_dim", "n_ff", "vocab", "capacity",
                                        "window", "act", "gated", "threads")] + [
        ("norm_eps", ctypes.c_double), ("act_alpha", ctypes.c_double), ("attn_scale", ctypes.c_double),
        ("residual_ratio", ctypes.c_double),
        ("embed", _P), ("final_norm", _P), ("rope_cos", _P), ("rope_sin", _P), ("rope_positions", _I),
        ("head", TdmWeight), ("layers", ctypes.POINTER(TdmLayer)), ("work", _P),
        ("embed_scale", ctypes.c_double), ("logit_softcap", ctypes.c_double),  # 0: none (Gemma: sqrt(d), cap)
        ("norm_kind", _I), ("final_norm_bias", _P), ("pos_embed", _P),  # OPT: 1 = LayerNorm; [positions, d]
        ("kv_half", _I)]  # 1: the KV caches the layers point at hold float16 (set by StepCalls.point_layers)


class TdmBatch(ctypes.Structure):  # batch.h: the multi-token step's tokens, positions and block tables
    _fields_ = [("n_tokens", _I), ("tokens", _P), ("pos", _P), ("tables", _P), ("table_stride", _I),
                ("block_tokens", _I), ("kv_rows", _I), ("span", _I), ("want", _P), ("logits", _P)]


def bind_signatures(lib: ctypes.CDLL) -> None:
    lib.tdm_decode.argtypes = [ctypes.POINTER(TdmModel), _I, _I, _P]
    lib.tdm_decode.restype = _I
    lib.tdm_work_bytes.argtypes = [ctypes.POINTER(TdmModel)]
    lib.tdm_work_bytes.restype = _I
    lib.tdm_dot_rows.argtypes = [ctypes.POINTER(TdmWeight), _I, _I, _P, ctypes.c_double, _P]
    lib.tdm_dot_rows.restype = None
    lib.tdm_pred_scratch_bytes.argtypes = [_I, _I]
    lib.tdm_pred_scratch_bytes.restype = _I
    for name in ("tdm_simd_features", "tdm_has_avx2", "tdm_amx_state"):  # (older kernels: tdm_has_avx2 alone)
        if hasattr(lib, name):
            getattr(lib, name).argtypes, getattr(lib, name).restype = [], _I
    lib.tdm_dequantize_rows.argtypes = [ctypes.POINTER(TdmWeight), _I, _I, _P]
    lib.tdm_dequantize_rows.restype = None
    lib.tdm_gemv_rows.argtypes = [ctypes.POINTER(TdmWeight), _P, _I, _I, _P, _P, _I]
    lib.tdm_gemv_rows.restype = _I
    _W = ctypes.POINTER(TdmWeight)
    lib.tdm_ffn_fused.argtypes = [_W, _W, _W, _I, _P, _P, _I, ctypes.c_double, ctypes.c_double, _P, _P, _P, _I, _P, _I]
    lib.tdm_ffn_fused.restype = _I
    lib.tdm_dot_rows_idx.argtypes = [ctypes.POINTER(TdmWeight), _P, _I, _P, ctypes.c_double, _P]
    lib.tdm_dot_rows_idx.restype = None
    if hasattr(lib, "tdm_quantize_q8"):
        lib.tdm_quantize_q8.argtypes = [_P, _I, ctypes.c_double, _P, _P, _P, _P, _P]
        lib.tdm_quantize_q8.restype = _I
    lib.tdm_decode_range.argtypes = [ctypes.POINTER(TdmModel), _I, _I, _I, _P, _P]
    lib.tdm_decode_range.restype = _I
    if hasattr(lib, "tdm_decode_parts"):  # (bench A/Bs load libraries built from older refs too)
        lib.tdm_decode_parts.argtypes = [ctypes.POINTER(TdmModel), _I, _I, _I, _P, _I]
        lib.tdm_decode_parts.restype = _I
    if hasattr(lib, "tdm_embed"):
        lib.tdm_embed.argtypes = [ctypes.POINTER(TdmModel), _I, _I, _P]
        lib.tdm_embed.restype = None
    lib.tdm_decode_batch.argtypes = [ctypes.POINTER(TdmModel), ctypes.POINTER(TdmBatch)]
    lib.tdm_decode_batch.restype = _I
    lib.tdm_batch_work_bytes.argtypes = [ctypes.POINTER(TdmModel), _I, _I]
    lib.tdm_batch_work_bytes.restype = _I
    lib.tdm_dot_rows_multi.argtypes = [ctypes.POINTER(TdmWeight), _I, _I, _I, _P, ctypes.c_double, _P]
    lib.tdm_dot_rows_multi.restype = None
    lib.tdm_axpy_rows.argtypes = [ctypes.POINTER(TdmWeight), _P, _P, _I, _P]
    lib.tdm_axpy_rows.restype = None


def addr(a: np.ndarray | None) -> int | None:
    """The address of a C-contiguous array (None for None)."""
    if a is None:
        return None
    if not a.flags.c_contiguous:
        raise TandemError("native kernels need C-contiguous arrays")
    return a.ctypes.data


@dataclass(frozen=True)
class WeightRef:
    """A descriptor and the arrays it points into (kept alive with it)."""
    desc: TdmWeight
    arrays: tuple


def describe(w, dot_input: bool = True) -> WeightRef:
    """Descriptor of a packed weight. ``dot_input``: used as a row-dot matrix (int8 activations need
    in_features divisible by 32); False for the transposed down projection (row axpys)."""
    rows, cols = w.shape
    if dot_input and not isinstance(w, Fp32Weight) and cols % 32:
        raise TandemError(f"native kernels need in_features divisible by 32, got {cols}")
    if isinstance(w, Fp32Weight):
        return _ref(KIND_F32, 1, w.w, None, None, 0)
    if isinstance(w, Fp16Weight):
        if dot_input:
            raise TandemError("native kernels read float16 weights only as down-projection rows")
        return _ref(KIND_F16, 1, w.w, None, None, 0)
    if isinstance(w, Int8Weight):
        return _ref(KIND_I8, 1, w.q, w.scale, None, 1)
    if isinstance(w, BlockInt8Weight):  # Q8_0: f16 scales read in place (blocks.h), or float32
        return _ref(KIND_I8H if w.scale.dtype == np.float16 else KIND_I8B, 32, w.q, w.scale, None, w.scale.shape[1])
    if isinstance(w, GGUFBlockWeight):  # Q5_0 / Q6_K / Q5_K blocks in place (kquants.h)
        if not dot_input:
            raise TandemError(f"native kernels read {w.qtype} blocks only as row-dot matrices (not down-projection rows)")
        return _ref(w.kind, w.group_size, w.blocks, None, None, 0, cols=cols)
    if not dot_input and (isinstance(w, Q4KWeight) or (isinstance(w, Int4Weight) and w.group_size != 32)):
        raise TandemError("native kernels read int4 down-projection rows only in groups of 32 (Q4_0 / Q4_1)")
    if isinstance(w, Q4KWeight):  # super-block scale bytes in place (blocks.h)
        return _ref(KIND_Q4K, 32, w.packed, w.sb, None, w.sb.shape[1], cols=cols)
    if isinstance(w, Int4Weight):
        if w.scale.dtype == np.float16:  # GGUF's f16 scale (and minimum; none for Q4_0) in place (blocks.h)
            return _ref(KIND_I4H, 32, w.packed, w.scale, w.minimum, w.scale.shape[1], cols=cols)
        scale, minimum = w.float_scales()
        return _ref(KIND_I4, w.group_size, w.packed, scale, minimum, w.scale.shape[1], cols=cols)
    raise TandemError(f"native kernels do not read {type(w).__name__}")


X8_ROWS = 8  # blocks_x8.h: rows per interleaved group
X8_KINDS = {KIND_I4H: KIND_I4X8, KIND_I8H: KIND_I8X8}  # in-place kind -> interleaved kind


def interleave(ref: WeightRef, lib, arena=None) -> WeightRef:
    """The row-dot weight ``ref`` with eight rows interleaved per vector (blocks_x8.h: Q4_0 / Q4_1 as
    KIND_I4X8, Q8_0 as KIND_I8X8; a block's integer dot product needs no horizontal sum, and the
    multi-token step unpacks a group once for all its tokens), or ``ref`` itself where that does not
    apply: another format, or a library without the kernel (an older build). The copy is new memory
    (ceil(rows / 8) * 8 rows of the GGUF blocks' bytes per row), read only by whole row ranges
    (dot_rows): gathered rows (predictor layers) keep the original. ``arena``: a WeightArena to
    place the copy in (huge pages), or None (a numpy allocation).

    Example::

        up = interleave(describe(ffn.up), native.lib)   # rows read densely by the fused step
    """
    d = ref.desc
    if d.kind not in X8_KINDS or not hasattr(lib, "tdm_repack_x8"):
        return ref
    lib.tdm_repack_x8.argtypes = [ctypes.POINTER(TdmWeight), _P]
    lib.tdm_repack_x8.restype = None
    kind, groups, blocks = X8_KINDS[d.kind], -(-d.rows // X8_ROWS), d.cols // 32
    block_bytes = 272 if kind == KIND_I8X8 else 160 if d.minimum else 144  # eight rows' block of 32 columns
    shape = (groups * X8_ROWS, blocks * block_bytes // X8_ROWS)
    data = arena.empty(shape, np.uint8) if arena is not None else np.empty(shape, dtype=np.uint8)
    lib.tdm_repack_x8(ctypes.byref(d), data.ctypes.data)
    desc = TdmWeight(kind=kind, group=32, rows=d.rows, cols=d.cols, data=addr(data),
                     row_bytes=data.strides[0], scale=None, minimum=None, scale_stride=0)
    return WeightRef(desc, (data,))


# the formats whose gathered row kernels read row r at `data + r * row_bytes`, `scale + r * stride`
PAIRED_KINDS = (KIND_I4H, KIND_I8H, KIND_I4, KIND_I8, KIND_I8B)


def pair_rows(gate: WeightRef, up: WeightRef, arena) -> WeightRef | None:
    """Gate and up rows of one FFN interleaved in ``arena``: gate row r at row 2r, up row r at 2r + 1 (codes,
    scales and minimums alike), so the predicted rows of a neuron are one contiguous read (predict.h
    paired_rows), or None where the two differ in kind or shape, or the kind keeps scales elsewhere
    (K-quants and the other in-place blocks, float32: the layer's two matrices stay). The pair is a copy; the
    layer's own gate / up stay for the step's other passes.

    Example::

        pair = pair_rows(describe(ffn.gate), describe(ffn.up), WeightArena())
        predictor.desc.gate_up = pair.desc          # None: leave gate_up empty
    """
    g, u = gate.desc, up.desc
    same = (g.kind, g.group, g.rows, g.cols, g.row_bytes, g.scale_stride) == (u.kind, u.group, u.rows, u.cols, u.row_bytes,
                                                                            u.scale_stride)
    if not same or g.kind not in PAIRED_KINDS or (g.kind == KIND_I4 and g.group != 32):
        return None
    if bool(g.scale) != bool(u.scale) or bool(g.minimum) != bool(u.minimum):
        return None
    fields = {}
    for name in ("data", "scale", "minimum"):
        a, b = _array_at(gate, getattr(g, name)), _array_at(up, getattr(u, name))
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or a.shape[0] != g.rows:
            return None
        pair = arena.empty((2 * a.shape[0],) + a.shape[1:], a.dtype)  # [2 rows, ...]
        pair[0::2], pair[1::2] = a, b
        fields[name] = pair
    desc = TdmWeight(kind=g.kind, group=g.group, rows=2 * g.rows, cols=g.cols, data=addr(fields["data"]),
                     row_bytes=g.row_bytes, scale=addr(fields.get("scale")), minimum=addr(fields.get("minimum")),
                     scale_stride=g.scale_stride)
    return WeightRef(desc, tuple(fields.values()))


def _array_at(ref: WeightRef, address) -> np.ndarray | None:
    """The array of ``ref`` that starts at ``address`` (a descriptor field), C-contiguous rows; None for NULL."""
    if not address:
        return None
    for a in ref.arrays:
        if isinstance(a, np.ndarray) and a.ctypes.data == address and a.flags.c_contiguous:
            return a
    return None


def _ref(kind: int, group: int, data: np.ndarray, scale, minimum, stride: int, cols: int | None = None) -> WeightRef:
    desc = TdmWeight(kind=kind, group=group, rows=data.shape[0], cols=cols if cols is not None else data.shape[1],
                     data=addr(data), row_bytes=data.strides[0], scale=addr(scale), minimum=addr(minimum),
                     scale_stride=stride)
    return WeightRef(desc, tuple(a for a in (data, scale, minimum) if a is not None))
