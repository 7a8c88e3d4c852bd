"""A predictor in closed form: the layer's own pre-activation projection, reduced to rank r.

Whether a ReLU-family neuron fires is decided by its pre-activation ``g = W x + b`` (the gate of a
gated FFN, the up projection of a plain one). Where ``W`` is mostly low-rank in the directions the
inputs actually take (PowerInfer's and Deja Vu's observation, and how the synthetic models are made),
the best rank-r copy of ``W x`` in mean square over the inputs predicts ``g`` almost exactly with no
training: reduced-rank regression of ``g`` on ``x``, whose solution is the SVD of ``W S^(1/2)``
(``S`` the inputs' second moment), mapped back by ``S^(-1/2)``. It runs in the same scorer as the
trained ones (``W2 relu(W1 x + b1) + b2``) with ``W1 = [A; -A]`` and ``W2 = [B, -B]``: relu(a) -
relu(-a) = a, so the scorer's rank is 2r and its score is ``B A x + b``, the predicted pre-activation.

Example::

    basis = preactivation_basis(x_train, w.gate)         # once per layer
    pred = linear_predictor(basis, directions=48, bias=w.gate_bias)   # LayerPredictor, rank 96
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import LayerPredictor

MAX_TOKENS = 16384  # tokens the second moment is estimated from
RIDGE = 1e-6  # relative to the mean eigenvalue: keeps S^(-1/2) finite on flat directions


@dataclass(frozen=True)
class PreactivationBasis:
    """Input directions A [k, d] (rows, strongest first; each A_j x has unit mean square) and their
    output maps B [F, k] (B[:, j] = W S^(1/2) v_j): ``W x ~= B[:, :r] A[:r] x``."""
    a: torch.Tensor
    b: torch.Tensor


@torch.no_grad()
def preactivation_basis(x: torch.Tensor, weight: torch.Tensor) -> PreactivationBasis:
    """The reduced-rank directions of x [N, d] -> weight [F, d] @ x (all d of them, strongest first)."""
    xs = x[:MAX_TOKENS].double()  # [N, d]
    second = xs.T @ xs / xs.shape[0]  # [d, d]
    evals, evecs = torch.linalg.eigh(second)
    evals = evals.clamp_min(RIDGE * float(evals.mean().clamp_min(1e-30)))
    root = (evecs * evals.sqrt()) @ evecs.T  # S^(1/2)
    inv_root = (evecs * evals.rsqrt()) @ evecs.T  # S^(-1/2)
    m = weight.double() @ root  # [F, d]
    _, v = torch.linalg.eigh(m.T @ m)  # right singular vectors of m, ascending
    v = v.flip(1)  # [d, d] strongest first
    return PreactivationBasis(a=(v.T @ inv_root).float(), b=(m @ v).float())


@torch.no_grad()
def linear_predictor(basis: PreactivationBasis, directions: int, bias: torch.Tensor | None = None) -> LayerPredictor:
    """The scorer of rank 2 * ``directions`` whose score is the rank-``directions`` pre-activation (plus ``bias``)."""
    k = min(directions, basis.a.shape[0])
    a, b = basis.a[:k], basis.b[:, :k]  # [k, d], [F, k]
    pred = LayerPredictor(a.shape[1], 2 * k, b.shape[0])
    pred.down.weight.copy_(torch.cat([a, -a]))
    pred.down.bias.zero_()
    pred.up.weight.copy_(torch.cat([b, -b], dim=1))
    if bias is not None:
        pred.up.bias.copy_(bias.float())
    else:
        pred.up.bias.zero_()
    return pred.eval().requires_grad_(False)
