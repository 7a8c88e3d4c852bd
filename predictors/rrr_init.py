"""A reduced-rank-regression start for a predictor: most of what a low-rank scorer can learn, in closed form.

Adam from a random start needs hundreds of steps to find the few input directions that decide which
neurons fire; with a few thousand calibration tokens it gets a few dozen. Ridge-regressing the
centred labels on x gives a map B [d, n_ff] whose top left-singular vectors are those directions
(exactly so when the gates are a low-rank function of x, as in ReLU models' predictable part).
``W1 = [V; -V]`` (so ReLU keeps both signs; one sign each when more directions matter than pairs
fit) and a least-squares ``W2`` on the features give a scorer that training then refines.

Example::

    init_reduced_rank(pred, x_train, y_train)     # before the Adam epochs
"""
from __future__ import annotations

import torch

MAX_TOKENS = 8192
RIDGE = 1e-2
LOGIT_SCALE = 8.0  # centred labels (-rate .. 1 - rate) -> logits of useful size


@torch.no_grad()
def reduced_rank_basis(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(directions u [d, d] strongest first, their singular values [d]) of the ridge map x -> centred y.
    Computed once per layer (eigen-decomposition of B B^T, d x d) and shared by every rank tried."""
    xs = x[:MAX_TOKENS].float()  # [N, d]
    yc = y[:MAX_TOKENS].float()
    yc = yc - yc.mean(0, keepdim=True)  # [N, F]
    d = xs.shape[1]
    gram = xs.T @ xs  # [d, d]
    gram += RIDGE * gram.diagonal().mean() * torch.eye(d)
    b = torch.linalg.solve(gram, xs.T @ yc)  # [d, F]
    evals, evecs = torch.linalg.eigh(b @ b.T)  # ascending
    return evecs.flip(1), evals.flip(0).clamp_min(0).sqrt()


@torch.no_grad()
def init_reduced_rank(pred, x: torch.Tensor, y: torch.Tensor, basis=None) -> None:
    rank = pred.rank
    k = rank // 2
    u, sv = basis if basis is not None else reduced_rank_basis(x, y)
    xs = x[:MAX_TOKENS].float()
    yc = y[:MAX_TOKENS].float()
    yc = yc - yc.mean(0, keepdim=True)
    energy = torch.cumsum(sv ** 2, 0) / (sv ** 2).sum().clamp_min(1e-12)
    effective = int((energy < 0.95).sum()) + 1  # directions holding 95% of the map
    w1 = pred.down.weight.detach().clone()  # rows not set below keep their random start
    if effective <= k:  # low-rank rule: both signs of each direction (ReLU keeps the linear map)
        k = min(k, u.shape[1])
        dirs = _unit(u[:, :k].T, xs)  # [k, d]
        w1[:k], w1[k:2 * k] = dirs, -dirs
    else:  # more directions matter than pairs fit: one sign each, the strongest first
        m = min(rank, u.shape[1])
        w1[:m] = _unit(u[:, :m].T, xs)
    pred.down.weight.copy_(w1)
    pred.down.bias.zero_()
    feats = torch.relu(xs @ w1.T)  # [N, rank]
    feats = torch.cat([feats, torch.ones(feats.shape[0], 1)], 1)  # with the output bias
    sol = torch.linalg.lstsq(feats, LOGIT_SCALE * yc + pred.up.bias[None], driver="gelsd").solution  # [rank + 1, F]
    pred.up.weight.copy_(sol[:-1].T)
    pred.up.bias.copy_(sol[-1])


def _unit(dirs: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """Rows scaled so each feature dirs @ x has unit variance over the tokens."""
    return dirs / (xs @ dirs.T).std(0).clamp_min(1e-6)[:, None]
