"""Activation predictors: one small MLP per FFN layer, and the set the runtime gates with.

A ``LayerPredictor`` maps the FFN input x [T, d] (the normalized hidden state the FFN sees) to one
score (a logit) per neuron: ``d -> rank -> n_ff`` with a ReLU in between, as in PowerInfer. Unlike
PowerInfer we keep biases: the output bias is each neuron's prior (its base rate, which is most of
what a hot/cold ReLU neuron needs) and costs only ``n_ff + rank`` parameters (about 2% of a
rank-32 predictor on SmolLM2). A neuron is predicted active when its score is >= the layer's
decision threshold (a logit, chosen at training time for a recall).

Each layer of a ``PredictorSet`` has a mode:

- ``"predictor"``: the MLP above picks the neurons; gate/up/down run only on those rows
  (the main lever for ReLU-family models);
- ``"gate"`` (SwiGLU-style gated layers with a magnitude threshold): the gate projection runs in
  full, then the up projection only on the rows where ``|act(gate_i)| * up_scale_i >= threshold``
  (up_scale_i = mean |up_i . x| on calibration text); measured on SmolLM2 this beats any learned
  predictor there (see the report in issue 4);
- ``"exact"``: no prediction: the exact path (gate/up in full, down only where |h| > threshold).

Example::

    pset = load_predictors("profiles/SmolLM2/predictors", expected_model_fingerprint=fp)
    mode = pset.mode(layer)
    if mode == "predictor":
        rows = pset.active_indices(layer, x)        # [n] int64 neuron ids, union over the T tokens
        mask = pset.active_mask(layer, x)           # [T, n_ff] bool, per token
    elif mode == "gate":
        a = act(x @ W_gate.T)                       # [T, n_ff], computed in full
        up_rows = pset.up_mask(layer, a)            # [T, n_ff] bool: compute up (and h) only there
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tandem.core.errors import TandemError

MODES = ("exact", "predictor", "gate")


class LayerPredictor(nn.Module):
    """``d_model -> rank -> n_ff`` scorer: logits = W2 relu(W1 x + b1) + b2."""

    def __init__(self, d_model: int, rank: int, n_ff: int) -> None:
        super().__init__()
        if min(d_model, rank, n_ff) <= 0:
            raise TandemError(f"predictor sizes must be positive, got d={d_model} rank={rank} n_ff={n_ff}")
        self.down = nn.Linear(d_model, rank)  # W1 [rank, d]
        self.up = nn.Linear(rank, n_ff)  # W2 [n_ff, rank]

    @property
    def rank(self) -> int:
        return self.down.out_features

    @property
    def d_model(self) -> int:
        return self.down.in_features

    @property
    def n_ff(self) -> int:
        return self.up.out_features

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def flops_per_token(self) -> int:
        """2 x multiply-adds for one token (biases and ReLU ignored)."""
        return 2 * self.rank * (self.d_model + self.n_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(torch.relu(self.down(x)))  # [T, n_ff] logits

    def state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{k}": v.detach().float().contiguous() for k, v in self.state_dict().items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "LayerPredictor":
        names = ("down.weight", "down.bias", "up.weight", "up.bias")
        missing = [n for n in names if f"{prefix}.{n}" not in tensors]
        if missing:
            raise TandemError(f"predictor tensors lack {prefix}.{missing[0]}")
        state = {n: tensors[f"{prefix}.{n}"] for n in names}
        w1, w2 = state["down.weight"], state["up.weight"]
        if w1.dim() != 2 or w2.dim() != 2 or w2.shape[1] != w1.shape[0]:
            raise TandemError(f"predictor {prefix} has inconsistent shapes {tuple(w1.shape)} and {tuple(w2.shape)}")
        module = cls(w1.shape[1], w1.shape[0], w2.shape[0])
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise TandemError(f"predictor {prefix} has bad tensors: {str(e).splitlines()[0]}") from None
        return module.eval().requires_grad_(False)


@dataclass
class LayerEntry:
    """One layer of a PredictorSet (see the module docstring for the modes)."""
    mode: str = "exact"
    predictor: LayerPredictor | None = None  # mode "predictor"
    up_scale: torch.Tensor | None = None  # [n_ff], mode "gate"
    threshold: float = 0.0  # mode "predictor": on the logit; mode "gate": on |act(gate)| * up_scale
    stats: dict[str, Any] = field(default_factory=dict)  # rank, recall, precision, predicted_sparsity, ...

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise TandemError(f"predictor mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "predictor" and self.predictor is None:
            raise TandemError("mode 'predictor' needs a predictor")
        if self.mode == "gate" and self.up_scale is None:
            raise TandemError("mode 'gate' needs up_scale")

    @property
    def use(self) -> bool:
        """True when the runtime skips work by prediction (False: exact path)."""
        return self.mode != "exact"

    @property
    def param_count(self) -> int:
        if self.mode == "predictor":
            return self.predictor.param_count
        return self.up_scale.numel() if self.mode == "gate" else 0


class PredictorSet:
    """Per-layer predictors with decision thresholds; the runtime's view of the predictor artifact.

    Example::

        pset = PredictorSet([LayerEntry("predictor", pred, threshold=-0.3), LayerEntry()])
        pset.active_indices(0, x)   # LongTensor of neuron ids predicted active for any token of x
        pset.mode(1)                # "exact": layer 1 takes the exact path
    """

    def __init__(self, entries: list[LayerEntry], meta: dict[str, Any] | None = None,
                 experts: dict[int, LayerEntry] | None = None) -> None:
        self.entries = list(entries)
        self.meta = dict(meta or {})
        self.experts = dict(experts or {})  # MoE: layer -> trained guess of layer+1's experts

    @property
    def num_layers(self) -> int:
        return len(self.entries)

    def entry(self, layer: int) -> LayerEntry:
        if not 0 <= layer < len(self.entries):
            raise TandemError(f"layer {layer} out of range (predictor set has {len(self.entries)} layers)")
        return self.entries[layer]

    def mode(self, layer: int) -> str:
        return self.entry(layer).mode

    def threshold(self, layer: int) -> float:
        return self.entry(layer).threshold

    @torch.inference_mode()
    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Logits [T, n_ff] of the layer's MLP predictor."""
        pred = self.entry(layer).predictor
        if pred is None:
            raise TandemError(f"layer {layer} has no MLP predictor (mode {self.mode(layer)!r})")
        return pred(x.to(pred.down.weight.dtype))  # [T, n_ff]

    def active_mask(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """Mode "predictor": bool [T, n_ff], the neurons predicted active per token. Other modes: None
        (no prediction from x: every gate row is computed)."""
        entry = self.entry(layer)
        if entry.mode != "predictor":
            return None
        return self.scores(layer, x) >= entry.threshold  # [T, n_ff]

    def active_indices(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """Mode "predictor": sorted int64 neuron ids predicted active for at least one token of x [T, d];
        other modes: None."""
        mask = self.active_mask(layer, x)
        return None if mask is None else mask.any(dim=0).nonzero().flatten()  # [n]

    def up_mask(self, layer: int, act_gate: torch.Tensor) -> torch.Tensor | None:
        """Mode "gate": bool [T, n_ff], the rows whose up projection is computed, from act(gate x)
        [T, n_ff] (the activated gate, computed in full). Other modes: None."""
        entry = self.entry(layer)
        if entry.mode != "gate":
            return None
        return act_gate.abs() * entry.up_scale >= entry.threshold  # [T, n_ff]

    @property
    def param_count(self) -> int:
        """Parameters the runtime holds for the used layers."""
        return sum(e.param_count for e in self.entries)
