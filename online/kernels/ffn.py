"""Torch-facing API over the C module kernels (cpu_kernels): one quantized FFN layer, one quantized linear layer.

Tensors in and out are float32 CPU torch tensors ``[T, features]`` (1-D ``[features]`` is accepted
and returned 1-D); they cross to numpy without copies. Decode (T small) runs the C kernels,
reading each weight row once for all T tokens; prefill (T > ``kernel_max_tokens(weight)``: 6 for
int8, 3 for int4, 1 for fp32) dequantizes the packed weights into a scratch float32 matrix per call
and uses torch's matmul, which is faster there (no float copy of the model is kept). Where the C
library cannot be built, every T takes that torch path.

The FFN keeps the down projection transposed (``down_t [n_ff, d]``, rows = neurons) so the sparse
down projection reads only the rows of active neurons (PowerInfer's CPU axpy form).

Example::

    ffn = QuantizedFFN.from_float(up=U, down=D, gate=G, fmt="int8", act="silu", threads=2)
    y = ffn.forward_dense(x)                        # x: float32 [T, 576] -> [T, 576]
    y, active = ffn.forward_sparse(x, threshold=0.05)
    y = ffn.forward_predicted(x, torch.tensor([3, 17, 42]))
    head = QuantizedLinear.from_gguf(ckpt.raw["model.embed_tokens.weight"])   # Q8_0, exact
    logits = head.forward(h)                        # [T, 49152]
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tandem.core.errors import TandemError
from . import cpu_kernels as K
from .quantize import Fp32Weight, Weight, quantize, weight_from_gguf

# Up to this many tokens the row kernels beat dequantize-per-call + torch matmul (measured on
# 1536x576, bench/kernels.md); fp32 weights need no dequantization, so torch wins from T = 2.
_KERNEL_MAX_TOKENS = {"Fp32Weight": 1, "Fp16Weight": 1, "Int8Weight": 6, "BlockInt8Weight": 6, "Int4Weight": 3,
                     "Q4KWeight": 3, "GGUFBlockWeight": 3}
KERNEL_MAX_TOKENS = max(_KERNEL_MAX_TOKENS.values())


def kernel_max_tokens(w: Weight) -> int:
    """Largest T for which a weight of this format goes through the row kernels."""
    return _KERNEL_MAX_TOKENS[type(w).__name__]
_EMPTY = np.zeros(0, dtype=np.float32)


def _weight_format(w: Weight) -> str:
    return {"Fp32Weight": "fp32", "Fp16Weight": "fp16", "Int8Weight": "int8", "BlockInt8Weight": "int8-block32",
            "Int4Weight": f"int4-g{getattr(w, 'group_size', 32)}", "Q4KWeight": "q4_k",
            "GGUFBlockWeight": getattr(w, "qtype", "").lower()}[type(w).__name__]


def _as_2d(x: Any, features: int, what: str) -> tuple[np.ndarray, bool]:
    """torch float32 [T, features] or [features] -> C-contiguous numpy [T, features] (zero copy when
    possible) and whether the input was 1-D. The common case costs ~1 us (it runs per layer per token)."""
    try:
        xn = x.numpy()  # raises for non-tensors, non-CPU tensors and tensors that require grad
    except (AttributeError, TypeError, RuntimeError):
        xn = None
    if xn is not None and xn.dtype == np.float32 and xn.flags.c_contiguous:
        if xn.ndim == 2 and xn.shape[1] == features:
            return xn, False
        if xn.ndim == 1 and xn.shape[0] == features:
            return xn.reshape(1, features), True
    if not isinstance(x, torch.Tensor):
        raise TandemError(f"{what}: expected a torch tensor, got {type(x).__name__}")
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise TandemError(f"{what}: expected a float32 CPU tensor, got {x.dtype} on {x.device}")
    squeeze = x.dim() == 1
    x2 = x.reshape(1, -1) if squeeze else x
    if x2.dim() != 2 or x2.shape[1] != features:
        raise TandemError(f"{what}: expected shape [T, {features}], got {list(x.shape)}")
    return x2.detach().contiguous().numpy(), squeeze


def _check_np(xn: Any, features: int, what: str) -> None:
    if not (isinstance(xn, np.ndarray) and xn.dtype == np.float32 and xn.ndim == 2 and xn.shape[1] == features
            and xn.flags.c_contiguous):
        raise TandemError(f"{what}: expected a C-contiguous float32 array [T, {features}]")


def _out(y: np.ndarray, squeeze: bool) -> torch.Tensor:
    t = torch.from_numpy(y)
    return t[0] if squeeze else t


def _bias(b: Any, n: int, name: str) -> np.ndarray:
    if b is None:
        return _EMPTY
    arr = np.ascontiguousarray(b.detach().float().numpy() if isinstance(b, torch.Tensor) else b, dtype=np.float32)
    if arr.shape != (n,):
        raise TandemError(f"{name} must have shape [{n}], got {list(arr.shape)}")
    return arr


def _raw(raw: Any) -> Weight:
    """RawQuantTensor-like (qtype, shape, data) -> packed weight, exact for Q8_0 / Q4_0 / Q4_1."""
    try:
        return weight_from_gguf(raw.data, raw.qtype, raw.shape)
    except AttributeError:
        raise TandemError("expected a raw GGUF tensor with .data, .qtype and .shape") from None


class QuantizedLinear:
    """y = x W^T (+ bias) with a packed weight (attention projections, output layer)."""

    def __init__(self, weight: Weight, bias: Any = None, threads: int = 2):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = _bias(bias, self.out_features, "bias")
        self.threads = K.clamp_threads(threads)
        self._max_tokens = kernel_max_tokens(weight)
        self._native_ref: Any = False  # False: not looked up yet; None: the C library is unavailable

    @classmethod
    def from_float(cls, w: torch.Tensor, fmt: str = "int8", bias: Any = None, group_size: int = 32,
                   threads: int = 2) -> "QuantizedLinear":
        return cls(quantize(w.detach().float().numpy(), fmt, group_size), bias, threads)

    @classmethod
    def from_gguf(cls, raw: Any, bias: Any = None, threads: int = 2) -> "QuantizedLinear":
        return cls(_raw(raw), bias, threads)

    @property
    def fmt(self) -> str:
        return _weight_format(self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.bias.nbytes

    def dequantize(self, threads: int = 1) -> torch.Tensor:
        """float32 [out, in] (a fresh matrix; fp32 weights are returned as they are). One thread by
        default: the prefill path alternates this with torch matmuls, and the C library's OpenMP pool
        and torch's are separate runtimes whose spinning workers fight over the cores when both wake."""
        if isinstance(self.weight, Fp32Weight):
            return torch.from_numpy(self.weight.w)
        ref = self._native()
        if ref is None:  # no C library: numpy's dequantization
            return torch.from_numpy(np.ascontiguousarray(self.weight.dequantize(), dtype=np.float32))
        out = np.empty((self.out_features, self.in_features), dtype=np.float32)
        return torch.from_numpy(K.dequantize_into(ref, out))

    def _native(self) -> Any:
        """This weight's C descriptor (None: the C library is unavailable)."""
        if self._native_ref is False:
            self._native_ref = _kernel_ref(self.weight)
        return self._native_ref

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 [len, in] (embedding lookup through a tied output layer)."""
        rows = ids.detach().reshape(-1).to(torch.int64).numpy()
        if rows.size and (rows.min() < 0 or rows.max() >= self.out_features):
            raise TandemError(f"token id out of range [0, {self.out_features})")
        return torch.from_numpy(self.weight.dequantize()[rows] if isinstance(self.weight, Fp32Weight)
                                else _dequantize_rows(self.weight, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xn, squeeze = _as_2d(x, self.in_features, "QuantizedLinear.forward")
        return _out(self.forward_numpy(xn), squeeze)

    def forward_numpy(self, xn: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Same on numpy: xn float32 C-contiguous [T, in] -> [T, out] (written into ``out`` when
        given). Skips the torch <-> numpy conversions (~2-3 us per call) for per-token loops."""
        _check_np(xn, self.in_features, "QuantizedLinear.forward_numpy")
        T = xn.shape[0]
        y = np.empty((T, self.out_features), dtype=np.float32) if out is None else out
        if y.shape != (T, self.out_features) or y.dtype != np.float32 or not y.flags.c_contiguous:
            raise TandemError(f"output buffer must be float32 C-contiguous [{T}, {self.out_features}]")
        if T > self._max_tokens or self._native() is None:
            torch.matmul(torch.from_numpy(xn), self.dequantize().T, out=torch.from_numpy(y))  # [T, out]
        else:
            K.gemv_rows(self._native(), None, xn, y, self.threads)
        if self.bias.size:
            y += self.bias
        return y

    def forward_rows(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Only the output features ``rows``: [T, len(rows)] (row-sparse projection)."""
        xn, squeeze = _as_2d(x, self.in_features, "QuantizedLinear.forward_rows")
        idx = _rows(rows, self.out_features)
        if self._native() is None:
            y = xn @ _dequantize_rows(self.weight, idx).T  # [T, len(rows)]
        else:
            y = K.gemv_rows(self._native(), idx, xn, np.empty((xn.shape[0], idx.size), np.float32), self.threads)
        if self.bias.size:
            y += self.bias[idx]
        return _out(y, squeeze)


def _rows(rows: Any, n: int) -> np.ndarray:
    idx = np.ascontiguousarray(rows.detach().numpy() if isinstance(rows, torch.Tensor) else rows).reshape(-1)
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise TandemError(f"row indices must be integers, got {idx.dtype}")
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise TandemError(f"row index out of range [0, {n})")
    return idx


def _kernel_ref(w: Weight) -> Any:
    """The C descriptor of ``w`` for the row kernels, or None where the C library is unavailable."""
    try:
        K.load_native()
    except K.NativeUnavailable:
        return None
    return K.kernel_weight(w)


def _dequantize_rows(w: Weight, rows: np.ndarray) -> np.ndarray:
    """Float32 [len(rows), in] of a packed weight without dequantizing the whole matrix."""
    sub = type(w)(**{f.name: (v[rows] if isinstance(v := getattr(w, f.name), np.ndarray) else v) for f in fields(w)})
    return sub.dequantize()


class QuantizedFFN:
    """One FFN layer h = act(gate x) * (up x) (plain: act(up x)), y = down h, on packed weights.

    ``down_t`` is the transposed down projection [n_ff, d]. ``forward_sparse`` computes gate/up in
    full and then only the down rows whose |h| > threshold; ``forward_predicted`` computes gate/up
    only for the given neurons and all their down rows. ``down`` (with ``down_t`` None): the down
    projection [d, n_ff] as the GGUF file stores it, one dense product over the kept h instead
    (fewer bytes than the sparse rows where sparsity is low; the fused step reads it in place).
    """

    def __init__(self, up: Weight, down_t: Weight | None, gate: Weight | None = None, act: str = "silu",
                 act_threshold: float = 0.0, up_bias: Any = None, gate_bias: Any = None,
                 down_bias: Any = None, threads: int = 2, down: Weight | None = None):
        if act not in K.ACT_IDS:
            raise TandemError(f"unsupported activation {act!r} (supported: {', '.join(K.ACT_IDS)})")
        self.n_neurons, self.d_model = up.shape
        self.down = down
        if (down_t is None) == (down is None) or (down is not None and down.shape != (self.d_model, self.n_neurons)):
            raise TandemError("QuantizedFFN needs either down_t [n_ff, d] or down [d, n_ff]")
        if (down_t or _Transposed(down)).shape != (self.n_neurons, self.d_model) or (gate is not None and gate.shape != up.shape):
            raise TandemError(f"FFN shapes disagree: up {list(up.shape)}, down^T {list((down_t or _Transposed(down)).shape)}"
                              + (f", gate {list(gate.shape)}" if gate is not None else ""))
        if act == "drelu" and gate is None:
            raise TandemError("dReLU needs a gated FFN")
        self.up, self.down_t, self.gate = up, down_t, gate
        self.act, self.act_threshold = act, float(act_threshold)
        self._act_id = K.ACT_IDS[act]
        self.up_bias = _bias(up_bias, self.n_neurons, "up bias")
        self.gate_bias = _bias(gate_bias, self.n_neurons, "gate bias")
        self.down_bias = _bias(down_bias, self.d_model, "down bias")
        self.threads = K.clamp_threads(threads)
        self._max_tokens = kernel_max_tokens(up)
        # prefill path (T > _max_tokens): the same packed weights, dequantized per call
        self._lin_up = QuantizedLinear(up, None, threads)
        self._lin_gate = QuantizedLinear(gate, None, threads) if gate is not None else None
        self._lin_down_t = QuantizedLinear(down_t, None, threads) if down_t is not None else None
        self._lin_down = QuantizedLinear(down, None, threads) if down is not None else None

    @classmethod
    def from_float(cls, up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None = None,
                   fmt: str = "int8", group_size: int = 32, down_fmt: str | None = None, **kw: Any) -> "QuantizedFFN":
        """From float weights in torch layout: up/gate [n_ff, d], down [d, n_ff]."""
        def q(t: torch.Tensor, f: str) -> Weight:
            return quantize(t.detach().float().numpy(), f, group_size)
        down_t = np.ascontiguousarray(down.detach().float().numpy().T)  # [n_ff, d]
        return cls(q(up, fmt), quantize(down_t, down_fmt or fmt, group_size),
                   q(gate, fmt) if gate is not None else None, **kw)

    @classmethod
    def from_gguf(cls, up: Any, down: Any, gate: Any = None, down_fmt: str = "int8",
                  group_size: int = 32, dense_down: bool = False, **kw: Any) -> "QuantizedFFN":
        """From raw GGUF tensors (RawQuantTensor-like). gate/up keep their blocks exactly (Q4_1 ->
        int4, Q8_0 -> block int8); the down projection is decoded and re-packed transposed in
        ``down_fmt`` (its GGUF blocks run along n_ff, the wrong axis for the sparse row form), or with
        ``dense_down`` kept as it is for one dense product (``down``; see the class docstring)."""
        down_w = _raw(down)
        if dense_down:
            return cls(_raw(up), None, _raw(gate) if gate is not None else None, down=down_w, **kw)
        down_t = np.ascontiguousarray(down_w.dequantize().T)  # [n_ff, d]
        return cls(_raw(up), quantize(down_t, down_fmt, group_size),
                   _raw(gate) if gate is not None else None, **kw)

    @property
    def nbytes(self) -> int:
        ws = (self.up, self.down_t, self.gate, self.down)
        return sum(w.nbytes for w in ws if w is not None) + self.up_bias.nbytes + self.gate_bias.nbytes + self.down_bias.nbytes

    @property
    def fmt(self) -> str:
        down = self.down_t if self.down is None else self.down
        return f"{_weight_format(self.up)}/down {_weight_format(down)}{'' if self.down is None else ' dense'}"

    def forward_numpy(self, xn: np.ndarray, threshold: float = -1.0,
                      rows: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """The FFN on numpy (no torch conversions): xn float32 C [T, d] -> (y [T, d], pairs used).
        threshold < 0: dense; >= 0: down rows only where |h| > threshold. ``rows`` (int64) limits
        gate/up to those neurons (predictor-gated; on the row kernels for every T)."""
        _check_np(xn, self.d_model, "QuantizedFFN.forward_numpy")
        if self.down is not None and (rows is not None or xn.shape[0] <= self._max_tokens):  # dense down (GGUF blocks)
            from .dense_down import forward_dense_down
            return forward_dense_down(self, xn, threshold, rows)
        if rows is not None:
            rows = _rows(rows, self.n_neurons)
        refs = None if self.down is not None else self._refs()  # a dense down: the torch product below
        if refs is None or (rows is None and xn.shape[0] > self._max_tokens):
            h = self._torch_hidden(torch.from_numpy(xn))  # [T, n_ff]
            keep = h.abs() > threshold
            if rows is not None:  # no C library: only the listed neurons
                keep &= torch.zeros(self.n_neurons, dtype=torch.bool).index_fill_(0, torch.from_numpy(rows), True)
            h, count = h * keep, int(keep.sum())
            return self._torch_down(h).numpy(), count
        y = np.empty((xn.shape[0], self.d_model), dtype=np.float32)
        gate, up, down = refs
        count = K.ffn_fused(gate, up, down, xn, self._act_id, self.act_threshold, float(threshold), self.gate_bias,
                            self.up_bias, rows, y, self.threads)
        if self.down_bias.size:
            y += self.down_bias
        return y, int(count)

    def _refs(self) -> tuple | None:
        """(gate, up, down_t) C descriptors (gate None for a plain FFN), or None without the C library."""
        up = self._lin_up._native()
        if up is None:
            return None
        return (self._lin_gate._native() if self._lin_gate is not None else None, up, self._lin_down_t._native())

    def _torch_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """h [T, n_ff] through dequantized weights (prefill path)."""
        u = x @ self._lin_up.dequantize().T  # [T, n_ff]
        if self.up_bias.size:
            u += torch.from_numpy(self.up_bias)
        if self._lin_gate is None:
            return _activate(self.act, u, self.act_threshold)
        g = x @ self._lin_gate.dequantize().T  # [T, n_ff]
        if self.gate_bias.size:
            g += torch.from_numpy(self.gate_bias)
        if self.act == "drelu":
            return F.relu(g) * F.relu(u)
        return _activate(self.act, g, self.act_threshold) * u

    def _torch_down(self, h: torch.Tensor) -> torch.Tensor:
        y = h @ (self._lin_down_t.dequantize() if self.down is None else self._lin_down.dequantize().T)  # [T, d]
        if self.down_bias.size:
            y += torch.from_numpy(self.down_bias)
        return y

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        xn, squeeze = _as_2d(x, self.d_model, "QuantizedFFN.forward_dense")
        return _out(self.forward_numpy(xn)[0], squeeze)

    def forward_sparse(self, x: torch.Tensor, threshold: float) -> tuple[torch.Tensor, int]:
        """(y, active): only neurons with |h| > threshold feed the down projection; ``active``
        counts the (token, neuron) pairs used (T * n_neurons when nothing is skipped)."""
        if not threshold >= 0.0:
            raise TandemError(f"sparsity threshold must be >= 0, got {threshold}")
        xn, squeeze = _as_2d(x, self.d_model, "QuantizedFFN.forward_sparse")
        y, count = self.forward_numpy(xn, threshold)
        return _out(y, squeeze), count

    def forward_predicted(self, x: torch.Tensor, active_idx: Any) -> torch.Tensor:
        """Only the neurons ``active_idx`` (e.g. a predictor's output), for every token. Predicted
        neurons whose h is exactly 0 (ReLU false positives) skip their down row (same result)."""
        xn, squeeze = _as_2d(x, self.d_model, "QuantizedFFN.forward_predicted")
        rows = active_idx.detach().numpy() if isinstance(active_idx, torch.Tensor) else active_idx
        return _out(self.forward_numpy(xn, 0.0, rows)[0], squeeze)


def _activate(act: str, g: torch.Tensor, alpha: float) -> torch.Tensor:
    if act == "silu":
        return F.silu(g)
    if act in ("relu", "drelu"):
        return F.relu(g)
    if act == "fatrelu":
        return torch.where(g > alpha, g, torch.zeros_like(g))
    if act == "gelu":
        return F.gelu(g)
    return F.gelu(g, approximate="tanh")


class _Transposed:  # the shape a dense down [d, n_ff] has as down_t
    def __init__(self, w: Weight) -> None:
        self.shape = (w.shape[1], w.shape[0])
