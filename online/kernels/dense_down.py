"""The module path of a QuantizedFFN whose down projection is dense (``down`` [d, n_ff], GGUF blocks as
the file stores them): gate/up through the C row kernels (``cpu_kernels.gemv_rows``; dequantized
weights through torch without the C library), the activation, the layer's threshold
(|h| <= threshold -> 0: the neurons the sparse rows would skip), then one product with ``down``
(C kernels: the fused step reads the same blocks in place; no float copy of the weight is kept).

Example::

    y, used = forward_dense_down(ffn, x, threshold=0.05, rows=None)   # x: float32 [T, d] -> [T, d]
"""
from __future__ import annotations

import numpy as np
import torch

from . import cpu_kernels as K


def forward_dense_down(ffn, xn: np.ndarray, threshold: float, rows: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(y [T, d], (token, neuron) pairs kept) for xn float32 C [T, d]; ``rows``: only these neurons' gate/up."""
    from .ffn import _activate, _rows

    T = xn.shape[0]
    idx = np.arange(ffn.n_neurons, dtype=np.int64) if rows is None else _rows(rows, ffn.n_neurons)
    up_ref = ffn._lin_up._native()
    if up_ref is None:  # no C library: every neuron through dequantized weights, then only the listed ones
        h = ffn._torch_hidden(torch.from_numpy(xn)).numpy()  # [T, n_ff]
        if rows is not None:
            h[:, np.setdiff1d(np.arange(ffn.n_neurons), idx)] = 0.0
    else:
        def product(ref, bias) -> torch.Tensor:
            out = np.empty((T, idx.size), dtype=np.float32)  # [T, len(idx)]
            K.gemv_rows(ref, None if rows is None else idx, xn, out, ffn.threads)
            if bias.size:
                out += bias[idx]
            return torch.from_numpy(out)

        u = product(up_ref, ffn.up_bias)
        if ffn.gate is None:
            h_sel = _activate(ffn.act, u, ffn.act_threshold)
        else:
            g = product(ffn._lin_gate._native(), ffn.gate_bias)
            h_sel = (torch.relu(g) * torch.relu(u)) if ffn.act == "drelu" else _activate(ffn.act, g, ffn.act_threshold) * u
        h = np.zeros((T, ffn.n_neurons), dtype=np.float32)  # [T, n_ff]
        h[:, idx] = h_sel.numpy()
    if threshold >= 0:
        keep = np.abs(h) > threshold
        h *= keep
        count = int(keep.sum())
    else:
        count = T * idx.size
    y = ffn._lin_down.forward_numpy(np.ascontiguousarray(h))  # [T, d]
    if ffn.down_bias.size:
        y += ffn.down_bias
    return y, count
