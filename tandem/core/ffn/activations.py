"""FFN activations: h = act(gate x) * (up x) for gated FFNs, h = act(up x) for plain ones."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def activate(kind: str, x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    if kind in ("relu", "drelu"):
        return F.relu(x)
    if kind == "fatrelu":  # ProSparse: keep values above the threshold, zero the rest
        return torch.where(x > threshold, x, torch.zeros_like(x))
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {kind!r}")


def gated_hidden(kind: str, gate: torch.Tensor, up: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """h [T, F] from gate and up projections [T, F]; dReLU (TurboSparse) applies ReLU to both."""
    if kind == "drelu":
        return F.relu(gate) * F.relu(up)
    return activate(kind, gate, threshold) * up
