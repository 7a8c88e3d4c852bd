"""Predictors as the hybrid runtime uses them: one callable per layer (or None for the exact path).

A layer in "predictor" mode returns the neuron ids predicted active for any token of x; layers in
"gate" or "exact" mode run the exact path in the runtime (gate mode's saving, ~4% of gate/up rows
on SmolLM2, is not worth a third kernel variant yet).

Example::

    per_layer, fingerprint = load_runtime_predictors(dir, model_fingerprint, profile_fingerprint)
    active = per_layer[0](x)   # int64 neuron ids, or per_layer[3] is None
"""
from __future__ import annotations

from pathlib import Path

from .artifact import load_predictors


class LayerGate:
    """``gate(x)`` -> int64 neuron ids predicted active for any token of x [T, d]; ``module`` and
    ``threshold`` (a logit) let the fused C step run the same scorer."""

    def __init__(self, pset, layer: int) -> None:
        self.pset, self.layer = pset, layer

    def __call__(self, x):
        return self.pset.active_indices(self.layer, x)

    @property
    def module(self):
        return self.pset.entry(self.layer).predictor

    @property
    def threshold(self) -> float:
        return float(self.pset.threshold(self.layer))


def load_runtime_predictors(predictors_dir: str | Path, model_fingerprint: str,
                            profile_fingerprint: str) -> tuple[list, str]:
    pset = load_predictors(predictors_dir, model_fingerprint, profile_fingerprint)
    per_layer = []
    for layer in range(len(pset.entries)):
        if pset.mode(layer) == "predictor":
            per_layer.append(LayerGate(pset, layer))
        else:
            per_layer.append(None)
    return per_layer, pset.meta["predictors_fingerprint"]
