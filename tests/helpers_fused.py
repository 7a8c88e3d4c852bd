"""An independent torch re-statement of the fused decode step's arithmetic (tests only).

The C step (online/kernels/native/decode.c) quantizes every matrix input to int8 per 32 values (plus
a second int8 residual on outlier blocks), keeps the int4 minimum term on exact float sums, and
adds only the down rows whose |h| passes the threshold. This module does the same with plain torch
ops on the dequantized weights, so tests can check the kernel's rounding, attention, rope, KV
writes and sparsity against it.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


BLOCK = 32


def quantized_activation(x: torch.Tensor, residual_ratio: float) -> torch.Tensor:
    """x [n] -> the value the kernels compute with: d*q (+ d/254 * r on flagged blocks)."""
    xb = x.float().reshape(-1, BLOCK)  # [nb, 32]
    amax = xb.abs().amax(dim=1, keepdim=True)  # [nb, 1]
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)
    value = d * q
    if residual_ratio >= 0:
        flagged = (d > residual_ratio * d.mean()) & (d > 0)  # [nb, 1]
        inv_r = torch.where(d > 0, 254.0 / d, torch.zeros_like(d))
        r = torch.round((xb - value) * inv_r)
        value = value + torch.where(flagged, (d / 254.0) * r, torch.zeros_like(value))
    return value.reshape(-1)


def matvec(w, x: torch.Tensor, residual_ratio: float) -> torch.Tensor:
    xq = quantized_activation(x, residual_ratio)
    if getattr(w, "qtype", None) == "Q5_K":  # scale x code on the int8 activation, minimum on exact block sums
        scaled, minimum = q5k_parts(w.blocks, w.shape)
        return torch.from_numpy(scaled) @ xq + torch.from_numpy(minimum) @ x.reshape(-1, 32).sum(1)
    if not hasattr(w, "codes"):  # Int4Weight, superblocks.Q4KWeight: int4 codes, per-group scale and minimum
        return torch.from_numpy(np.ascontiguousarray(w.dequantize())) @ xq
    group = w.group_size
    scale, minimum = w.float_scales()  # float32 [out, groups] (f16 / Q4_K scales expanded exactly)
    codes = torch.from_numpy(w.codes().astype(np.float32)).reshape(w.shape[0], -1, group)  # [out, groups, G]
    scaled = (codes * torch.from_numpy(scale)[:, :, None]).reshape(w.shape[0], -1)  # [out, in]
    return scaled @ xq + torch.from_numpy(minimum) @ x.reshape(-1, group).sum(1)


def q5k_parts(blocks: np.ndarray, shape) -> tuple[np.ndarray, np.ndarray]:
    """Q5_K blocks -> ((d sc) q [out, in], -(dmin m) [out, in / 32]) through gguf's decoder (dmin or the
    codes set to zero)."""
    import gguf

    rows, cols = shape
    b = blocks.reshape(-1, 176).copy()
    no_min = b.copy()
    no_min[:, 2:4] = 0
    b[:, 16:] = 0  # every code 0: each weight is -(dmin m)
    dq = lambda a: gguf.quants.dequantize(a, gguf.GGMLQuantizationType.Q5_K).reshape(rows, cols)
    return dq(no_min), np.ascontiguousarray(dq(b)[:, ::32])


def _bias(b) -> torch.Tensor | float:
    return torch.from_numpy(b) if b is not None and b.size else 0.0


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    t = t.reshape(-1, head_dim)
    half = head_dim // 2
    return t * cos + torch.cat([-t[:, half:], t[:, :half]], -1) * sin


def _act(name: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return {"silu": F.silu, "relu": F.relu}[name](g) * u


@torch.inference_mode()
def reference_step(model, executor, cache, token: int, pos: int, residual_ratio: float) -> tuple[torch.Tensor, int]:
    """(logits [vocab], FFN neurons used) for one token; writes k/v into ``cache`` like the kernel."""
    cfg = model.cfg
    hd, n_heads, n_kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    x = model.embed_tokens.weight[token].clone()  # [d]
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]  # [hd]
    used = 0
    for layer, block in enumerate(model.layers):
        attn = block.self_attn
        xn = F.rms_norm(x, (cfg.hidden_size,), block.input_layernorm.weight, cfg.norm_eps)
        parts = getattr(attn.qkv_proj, "parts", None) or [attn.qkv_proj.linear]  # q, k, v apart (SplitQKVModule)
        qkv = torch.cat([matvec(p.weight, xn, residual_ratio) + _bias(p.bias) for p in parts])
        q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd])
        q, k = _rope(q, cos, sin, hd), _rope(k, cos, sin, hd)  # [H, hd], [KV, hd]
        cache.keys[layer, :, pos] = k
        cache.values[layer, :, pos] = v.reshape(n_kv, hd)
        start = max(0, pos + 1 - cfg.sliding_window) if cfg.sliding_window else 0
        keys, values = cache.keys[layer, :, start: pos + 1].float(), cache.values[layer, :, start: pos + 1].float()  # [KV, S, hd]
        heads = []
        for h in range(n_heads):
            g = h // (n_heads // n_kv)
            p = torch.softmax(keys[g] @ q[h] / math.sqrt(hd), dim=0)  # [S]
            heads.append(p @ values[g])
        o = matvec(attn.o_proj.linear.weight, torch.cat(heads), residual_ratio) + _bias(attn.o_proj.linear.bias)
        x = x + o
        split = executor.splits[layer]
        ffn = split.cpu
        xn = F.rms_norm(x, (cfg.hidden_size,), block.post_attention_layernorm.weight, cfg.norm_eps)
        u = matvec(ffn.up, xn, residual_ratio)
        h = _act(cfg.hidden_act, matvec(ffn.gate, xn, residual_ratio), u) if cfg.mlp_gated else _act(cfg.hidden_act, u, 1.0)
        keep = h.abs() > split.threshold
        used += int(keep.sum())
        if getattr(ffn, "down", None) is not None:  # dense down (GGUF blocks): the kept h quantized like any input
            x = x + matvec(ffn.down, torch.where(keep, h, torch.zeros_like(h)), residual_ratio)
        else:
            down_t = torch.from_numpy(np.ascontiguousarray(ffn.down_t.dequantize()))  # [n_ff, d]
            x = x + torch.where(keep, h, torch.zeros_like(h)) @ down_t
        if split.down_bias is not None:
            x = x + split.down_bias
    xn = F.rms_norm(x, (cfg.hidden_size,), model.norm.weight, cfg.norm_eps)
    return matvec(executor.head.weight, xn, residual_ratio), used
