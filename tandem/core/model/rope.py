"""Rotary position embeddings (Hugging Face rotate-half layout), with linear and llama3 scaling."""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig


def rope_inverse_frequencies(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float64 for exact tables), scaling applied.

    ``local``: the windowed layers' table (base ``cfg.rope_local_theta``, no scaling; Gemma 3).
    """
    half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
    if local:
        return 1.0 / (cfg.rope_local_theta ** half)  # [hd/2]
    inv_freq = 1.0 / (cfg.rope_theta ** half)  # [hd/2]
    scaling = cfg.rope_scaling_dict
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        original_context = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = original_context / low_freq_factor
        high_freq_wavelen = original_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_tables(cfg: ModelConfig, n_positions: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [n_positions, head_dim] in float32."""
    inv_freq = rope_inverse_frequencies(cfg, local)  # [hd/2]
    positions = torch.arange(n_positions, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)  # [P, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [P, hd]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/sin [T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [T, heads, hd]
    return x * cos[:, None, :] + rotated * sin[:, None, :]
