"""Training per-layer activation predictors: class-weighted BCE, held-out split, adaptive rank.

Labels are the profile's activity definition: neuron i of layer l is active for a token when
|h_i| > threshold_l (threshold 0 for ReLU-family models: exact zeros), h the input of the down
projection, recomputed here from the collected FFN inputs x and the layer's weights.

Adaptive size: ranks are climbed from the ladder (16, 32, ... capped by d). At each rank the
decision threshold is set for the target recall on held-out tokens, which fixes the share of
neurons marked active p(r). The layer keeps the rank that minimises the work the FFN still does,
``predictor_flops(r) + p(r) * first_projection_flops``: climbing stops as soon as a larger rank no
longer pays for itself by skipping more rows (by at least ``rank_gain``), or could not even with a
perfect prediction. Larger ranks barely change p on SmolLM2 (measured), so it mostly stops at 16-32.
Each rank also tries the closed-form reduced-rank copy of the layer's pre-activation (gate_rrr.py),
which on low-rank gates (the synthetic ReLU models) is far more precise than a scorer trained on a
few thousand tokens, and costs no training.

Example::

    fit = fit_layer(x_train, labels_train, x_val, labels_val, gate_up_flops=4 * 576 * 1536,
                    settings=TrainSettings(target_recall=0.95))
    fit.predictor, fit.rank, fit.point.threshold, fit.point.recall, fit.point.active_fraction
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.core.config import ModelConfig
from tandem.core.ffn.activations import activate
from tandem.core.ffn.dense import ffn_hidden
from tandem.core.ffn.weights import FFNWeights
from tandem.core.errors import TandemError
from .model import LayerPredictor
from .gate_rrr import linear_predictor, preactivation_basis
from .rrr_init import init_reduced_rank, reduced_rank_basis

# Q4_0 / Q4_1 rows interleaved eight at a time run at ~1.04 of the read bandwidth and gathered rows at
# 0.72 (all of them) to 0.42 (a tenth): `tandem probe --fused`, 2026-11-24 (bench/RESULTS.md). A gathered
# row is priced at this many dense ones: by the rank ladder here and by the pipeline's options.
GATHERED_ROW_COST = 1.4

RANK_LADDER = (16, 32, 64, 128, 256, 512)
LINEAR_PRECISION_ENOUGH = 0.9  # a closed-form scorer this precise leaves a trained one little to gain
LINEAR_STEP = 16  # directions between closed-form scorers tried (rank 2 x 16 = 32: the C step's int8 blocks)


@dataclass(frozen=True)
class TrainSettings:
    target_recall: float = 0.95
    ranks: tuple[int, ...] = RANK_LADDER
    max_epochs: int = 4
    patience: int = 1  # epochs without held-out improvement before stopping
    batch_tokens: int = 256
    learning_rate: float = 5e-3
    max_pos_weight: float = 50.0
    rank_gain: float = 0.02  # a larger rank must cut the remaining work by at least this share
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.target_recall < 1.0:
            raise TandemError(f"target recall must be in (0, 1), got {self.target_recall}")
        if not self.ranks or any(r <= 0 for r in self.ranks) or list(self.ranks) != sorted(set(self.ranks)):
            raise TandemError(f"rank ladder must be increasing positive integers, got {self.ranks}")
        for name in ("max_epochs", "batch_tokens"):
            if getattr(self, name) < 1:
                raise TandemError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0 or self.patience < 0 or not 0 <= self.rank_gain < 1:
            raise TandemError("learning_rate must be > 0, patience >= 0 and rank_gain in [0, 1)")


@dataclass
class OperatingPoint:
    threshold: float  # logit decision threshold
    recall: float
    precision: float
    active_fraction: float  # share of (token, neuron) pairs predicted active


@dataclass
class LayerFit:
    predictor: LayerPredictor
    point: OperatingPoint
    work_flops: float  # predictor + predicted gate/up rows, per token
    tried: list[dict] = field(default_factory=list)  # rank, recall, precision, active_fraction, epochs

    @property
    def rank(self) -> int:
        return self.predictor.rank


def layer_labels(cfg: ModelConfig, w: FFNWeights, x: torch.Tensor, threshold: float,
                 chunk_tokens: int = 4096) -> torch.Tensor:
    """Bool [N, F]: |h| > threshold, h recomputed from the FFN inputs x [N, d]."""
    out = [ffn_hidden(cfg, w, x[i:i + chunk_tokens]).abs() > threshold for i in range(0, x.shape[0], chunk_tokens)]
    return torch.cat(out)  # [N, F]


def first_projection_flops(cfg: ModelConfig, n_ff: int, activity: str) -> int:
    """Per-token work a predictor can skip: the projection(s) the exact path computes in full.

    SwiGLU with a magnitude threshold needs gate AND up to know |h|; a ReLU-family FFN needs only
    the projection under the ReLU (gate, or up for plain FFNs); the rest is sparse either way.
    """
    n_full = 2 if (cfg.mlp_gated and activity == "threshold") else 1
    return 2 * cfg.hidden_size * n_ff * n_full


def operating_point(scores: torch.Tensor, labels: torch.Tensor, target_recall: float) -> OperatingPoint:
    """The highest decision threshold whose recall on (scores, labels) is >= target_recall.

    Exact and O(N): the threshold is the k-th largest score among the positives, k = ceil(target * P)
    (scikit-learn's precision_recall_curve gives the same point; the tests check it against it, but
    sorting millions of (token, neuron) pairs costs a second per call).
    """
    pos = scores[labels].float()  # [P]
    n_pos = pos.numel()
    if n_pos == 0:
        return OperatingPoint(threshold=float(scores.max()) + 1.0, recall=1.0, precision=1.0, active_fraction=0.0)
    k = min(n_pos, max(1, math.ceil(target_recall * n_pos - 1e-9)))
    threshold = float(torch.kthvalue(pos, n_pos - k + 1).values)
    pred = scores >= threshold
    tp = float((pos >= threshold).sum())
    return OperatingPoint(threshold=threshold, recall=tp / n_pos, precision=tp / max(float(pred.sum()), 1.0),
                          active_fraction=float(pred.float().mean()))


@torch.no_grad()
def predict_scores(pred: LayerPredictor, x: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    return torch.cat([pred(x[i:i + chunk_tokens]) for i in range(0, x.shape[0], chunk_tokens)])  # [N, F]


def _bce(logits: torch.Tensor, labels: torch.Tensor, pos_weight: torch.Tensor,
         weights: torch.Tensor | None) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels.float(), weight=weights, pos_weight=pos_weight)


def train_predictor(x_train: torch.Tensor, y_train: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
                    rank: int, settings: TrainSettings, w_train: torch.Tensor | None = None,
                    progress=None, basis=None) -> tuple[LayerPredictor, int]:
    """Adam on class-weighted BCE with early stopping on held-out loss; returns (predictor, epochs run).

    ``w_train`` [N, F] optional per-entry loss weights (e.g. larger for large activations).
    """
    torch.manual_seed(settings.seed)
    n, d = x_train.shape
    n_ff = y_train.shape[1]
    pred = LayerPredictor(d, rank, n_ff)
    rate = y_train.float().mean(dim=0).clamp(1e-4, 1 - 1e-4)  # [F] base rates
    with torch.no_grad():
        pred.up.bias.copy_(torch.log(rate / (1 - rate)))  # start from each neuron's prior
    init_reduced_rank(pred, x_train, y_train, basis)  # the deciding input directions, in closed form
    active = float(rate.mean())
    pos_weight = torch.tensor(min(max((1 - active) / max(active, 1e-6), 1.0), settings.max_pos_weight))
    opt = torch.optim.Adam(pred.parameters(), lr=settings.learning_rate)
    best_loss, best_state, bad_epochs, epochs = math.inf, None, 0, 0
    gen = torch.Generator().manual_seed(settings.seed)
    for epoch in range(settings.max_epochs):
        pred.train()
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, settings.batch_tokens):
            idx = order[i:i + settings.batch_tokens]
            loss = _bce(pred(x_train[idx]), y_train[idx], pos_weight, None if w_train is None else w_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        pred.eval()
        with torch.no_grad():
            val_loss = float(_bce(predict_scores(pred, x_val), y_val, pos_weight, None))
        epochs = epoch + 1
        if progress is not None:
            progress.set_postfix_str(f"rank {rank} epoch {epochs} val {val_loss:.4f}", refresh=False)
        if val_loss < best_loss - 1e-5:
            best_loss, best_state, bad_epochs = val_loss, copy.deepcopy(pred.state_dict()), 0
        else:
            bad_epochs += 1
            if bad_epochs > settings.patience:
                break
    pred.load_state_dict(best_state)
    return pred.eval().requires_grad_(False), epochs


def fit_layer(x_train: torch.Tensor, y_train: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
              gate_up_flops: int, settings: TrainSettings, w_train: torch.Tensor | None = None,
              progress=None, preactivation: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> LayerFit:
    """Climb the rank ladder; keep the rank with the least remaining FFN work at the target recall.

    ``preactivation`` (weight [F, d], bias [F] or None): the projection whose sign decides firing
    (the gate; up for plain FFNs). Its closed-form reduced-rank copies (gate_rrr.py) are tried first,
    at every LINEAR_STEP directions while the work falls; a trained scorer is then trained only at
    ranks where it could still do less work and where the copy of that rank is not nearly exact."""
    d, n_ff = x_train.shape[1], y_train.shape[1]
    active = float(y_train.float().mean())
    tried: list[dict] = []

    def measure(kind: str, pred: LayerPredictor, epochs: int) -> LayerFit:
        point = operating_point(predict_scores(pred, x_val), y_val, settings.target_recall)
        work = pred.flops_per_token + GATHERED_ROW_COST * point.active_fraction * gate_up_flops
        tried.append({"rank": pred.rank, "kind": kind, "recall": point.recall, "precision": point.precision,
                      "active_fraction": point.active_fraction, "work_flops": work, "epochs": epochs})
        return LayerFit(pred, point, work)

    linear: dict[int, LayerFit] = {}  # scorer rank -> the closed-form fit
    best: LayerFit | None = None
    if preactivation is not None:
        pre_basis = preactivation_basis(x_train, preactivation[0])
        for k in range(LINEAR_STEP, d // 2 + 1, LINEAR_STEP):
            fit = linear[2 * k] = measure("linear", linear_predictor(pre_basis, k, preactivation[1]), 0)
            if best is not None and fit.work_flops >= best.work_flops * (1 - settings.rank_gain):
                best = min(best, fit, key=lambda f: f.work_flops)
                break  # more directions no longer pay for themselves
            best = fit
    best_trained: LayerFit | None = None
    basis = None  # the trained scorers' closed-form start: once per layer, shared by the ranks tried
    for rank in (r for r in settings.ranks if r <= d):
        floor = 2 * rank * (d + n_ff) + active * gate_up_flops  # a perfect scorer of this rank
        if best is not None and floor >= best.work_flops:
            break  # even a perfect predictor of this size could not do less work
        if rank in linear and linear[rank].point.precision >= LINEAR_PRECISION_ENOUGH:
            break  # the closed-form scorer of this rank is nearly exact: nothing left to train for
        basis = basis if basis is not None else reduced_rank_basis(x_train, y_train)
        pred, epochs = train_predictor(x_train, y_train, x_val, y_val, rank, settings, w_train, progress, basis)
        fit = measure("trained", pred, epochs)
        if best_trained is not None and fit.work_flops >= best_trained.work_flops * (1 - settings.rank_gain):
            break  # a larger trained scorer no longer pays for itself
        best_trained = fit if best_trained is None or fit.work_flops < best_trained.work_flops else best_trained
        best = fit if best is None or fit.work_flops < best.work_flops else best
    if best is None:
        raise TandemError("no rank in the ladder fits this layer")
    best.tried = tried
    return best


@torch.no_grad()
def miss_error(cfg: ModelConfig, w: FFNWeights, x: torch.Tensor, mask: torch.Tensor, threshold: float) -> float:
    """Relative squared error of the FFN output when the masked-out neurons are skipped (on top of
    the exact threshold): ||W_down (h_t * ~mask)||^2 / ||W_down h_t||^2, h_t = h * (|h| > threshold)."""
    h = ffn_hidden(cfg, w, x)  # [N, F]
    if threshold > 0:
        h = h * (h.abs() > threshold)
    ref = F.linear(h, w.down)  # [N, d]
    missed = F.linear(h * ~mask, w.down)  # [N, d]
    return float(missed.pow(2).sum() / ref.pow(2).sum().clamp_min(1e-30))


def gate_mode_applies(cfg: ModelConfig, activity: str) -> bool:
    """Mode "gate" (gate in full, up on rows with large |act(gate)|) serves gated FFNs whose
    activity is a magnitude threshold; for ReLU-family FFNs the exact path already does that."""
    return cfg.mlp_gated and activity == "threshold"


@torch.no_grad()
def gate_scores(cfg: ModelConfig, w: FFNWeights, x: torch.Tensor, up_scale: torch.Tensor,
                chunk_tokens: int = 4096) -> torch.Tensor:
    """|act(gate x)| * up_scale [N, F]: the mode-"gate" estimate of |h|."""
    out = []
    for i in range(0, x.shape[0], chunk_tokens):
        a = activate(cfg.hidden_act, F.linear(x[i:i + chunk_tokens], w.gate, w.gate_bias), cfg.act_threshold)
        out.append(a.abs() * up_scale)
    return torch.cat(out)  # [N, F]


@torch.no_grad()
def up_scale_of(w: FFNWeights, x: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean |up_i . x| per neuron [F] over the tokens x [N, d]."""
    total = torch.zeros(w.n_neurons, dtype=torch.float64)
    for i in range(0, x.shape[0], chunk_tokens):
        total += F.linear(x[i:i + chunk_tokens], w.up, w.up_bias).abs().sum(dim=0).double()
    return (total / max(x.shape[0], 1)).float()
