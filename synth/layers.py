"""Synthetic layer weights, built layer by layer against a float forward of sample tokens.

The model is made to behave like a ReLU-sparse LLM (PowerInfer's setting) while staying a plain
llama.cpp ``llama`` model:

- **Bias channel.** The first ``BIAS_DIMS`` residual coordinates are 1 in every embedding row and no
  layer writes to them (zero rows in ``attn_output``/``ffn_down``), so after RMSNorm they carry a
  near-constant value: gate rows put their bias there (llama GGUFs have no FFN biases).
- **Gate.** ``gate = scale * (U V x + noise + b)``: a rank-``gate_rank`` part (what a low-rank
  predictor can learn), a small full-rank noise, and per-neuron biases ``b`` calibrated on sample
  FFN inputs so neuron i fires (gate > 0) with its target rate. Active gates are large
  (``gate_scale``), so SiLU(gate) ~= ReLU(gate) and llama.cpp's SiLU model computes nearly the same
  as Tandem's ReLU reading of the file (the gap is measured).
- Up/down and attention are random; layer outputs are scaled to a fixed share of the residual.

Every weight goes through the chosen GGUF quantization and the forward uses the dequantized
values, so the statistics measured on held-out tokens are those of the written file.

Example::

    q, w = roundtrip(np.ones((4, 32), np.float32), "Q4_0")   # uint8 [4, 18] blocks, float32 [4, 32]
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tandem.core.loading.gguf_loader import rope_unpermute_index

BIAS_DIMS = 32


def roundtrip(w: np.ndarray, qtype: str) -> tuple[np.ndarray, torch.Tensor]:
    """(GGUF blocks as uint8 [rows, row_bytes], the dequantized float32 torch tensor)."""
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[qtype]
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == "F32":
        return w.view(np.uint8).reshape(w.shape[0], -1), torch.from_numpy(w)
    q = quants.quantize(w.reshape(-1, w.shape[-1]), t)
    return q, torch.from_numpy(np.ascontiguousarray(quants.dequantize(q, t).reshape(w.shape), dtype=np.float32))


def rms_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def gaussian(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= std
    return out


def rope_tables(head_dim: int, positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None]  # [T, hd/2]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the HF layout the loader produces). x: [S, H, T, hd]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF-layout Q/K rows -> llama.cpp's interleaved rows (the loader undoes it)."""
    out = np.empty_like(w)
    out[rope_unpermute_index(n_heads, w.shape[0])] = w
    return out


def attention(rng, shape, qtype: str, h: torch.Tensor, out_rms: float, cos, sin) -> tuple[dict, torch.Tensor]:
    """Random attention; returns ({stem: blocks}, attention output [S, T, d])."""
    S, T, d = h.shape
    hd, nh, nkv = shape.head_dim, shape.n_heads, shape.n_kv_heads
    xn = rms_norm(h)
    blocks, mats = {}, {}
    for stem, rows, heads in (("attn_q", nh * hd, nh), ("attn_k", nkv * hd, nkv), ("attn_v", nkv * hd, None)):
        w = gaussian(rng, (rows, d), 1.0 / math.sqrt(d))
        stored = rope_permute(w, heads) if heads else w
        blocks[stem], deq = roundtrip(stored, qtype)
        mats[stem] = deq[torch.from_numpy(rope_unpermute_index(heads, rows))] if heads else deq  # loader's view
    q = (xn @ mats["attn_q"].T).view(S, T, nh, hd).transpose(1, 2)
    k = (xn @ mats["attn_k"].T).view(S, T, nkv, hd).transpose(1, 2)
    v = (xn @ mats["attn_v"].T).view(S, T, nkv, hd).transpose(1, 2)
    q, k = rope(q, cos[:T], sin[:T]), rope(k, cos[:T], sin[:T])
    rep = nh // nkv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [S, H, T, hd]
    att = att.transpose(1, 2).reshape(S, T, nh * hd)
    wo = gaussian(rng, (d, nh * hd), 1.0)
    wo[:BIAS_DIMS] = 0.0
    raw = att @ torch.from_numpy(wo).T
    wo *= out_rms / max(float(raw[..., BIAS_DIMS:].pow(2).mean().sqrt()), 1e-12)
    blocks["attn_output"], deq = roundtrip(wo, qtype)
    return blocks, att @ deq.T


def sparse_ffn(rng, spec, d: int, n_ff: int, rates: np.ndarray, xn_cal: torch.Tensor) -> dict:
    """Float gate/up/down [n_ff, d], [n_ff, d], [d, n_ff] (down unscaled) calibrated on xn_cal [N, d]."""
    rank = min(spec.gate_rank, (d - BIAS_DIMS) // 2)
    basis, _ = np.linalg.qr(gaussian(rng, (d - BIAS_DIMS, rank), 1.0))  # [d', r] orthonormal columns
    lowrank = gaussian(rng, (n_ff, rank), 1.0 / math.sqrt(rank)) @ basis.T  # [n_ff, d']
    noise = gaussian(rng, (n_ff, d - BIAS_DIMS), spec.gate_noise / math.sqrt(d - BIAS_DIMS))
    w = torch.from_numpy(np.ascontiguousarray(lowrank + noise, dtype=np.float32))  # [n_ff, d']
    x = xn_cal[:, BIAS_DIMS:]
    c = xn_cal[:, :BIAS_DIMS].mean(1, keepdim=True)  # [N, 1] the bias channel's value
    z = x @ w.T  # [N, n_ff]
    std = z.std(0).clamp_min(1e-6)
    z /= std
    w /= std[:, None]
    ratio, _ = torch.sort(z / c, dim=0)  # neuron i fires when z_i / c > -b_i
    n = ratio.shape[0]
    k = torch.from_numpy(np.clip(np.round((1.0 - rates) * n), 0, n - 1).astype(np.int64))
    thr = ratio.gather(0, k[None])[0]  # [n_ff]
    gate = np.empty((n_ff, d), np.float32)
    gate[:, BIAS_DIMS:] = w.numpy()
    gate[:, :BIAS_DIMS] = (-thr.numpy() / BIAS_DIMS)[:, None]
    gate *= spec.gate_scale
    up = gaussian(rng, (n_ff, d), 1.0 / math.sqrt(d))
    up[:, :BIAS_DIMS] = 0.0
    down = gaussian(rng, (d, n_ff), 1.0)
    down[:BIAS_DIMS] = 0.0
    return {"gate": gate, "up": up, "down": down, "rank": rank,
            "lowrank_share": float(1.0 / (1.0 + spec.gate_noise ** 2))}


def ffn_apply(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, xn: torch.Tensor, silu: bool = False):
    g = xn @ gate.T
    a = torch.nn.functional.silu(g) if silu else torch.relu(g)
    return (a * (xn @ up.T)) @ down.T, g > 0
