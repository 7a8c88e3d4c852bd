"""What the planner needs to know about activation predictors, one entry per layer.

The predictor artifact (``predictors/``) is the source of these numbers; ``load_predictor_info``
is the one seam that reads it. Without predictors every layer takes the exact path (compute the
first FFN projection in full, then only the rows of the rest that are active).

Example::

    info = no_predictors(num_layers=30)
    info.layers[0].used        # False
    info.fingerprint           # 'none'
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tandem.core.errors import TandemError

NO_PREDICTORS_FINGERPRINT = "none"


@dataclass(frozen=True)
class LayerPredictorInfo:
    """One layer's predictor: whether the runtime uses it, its size, and how it behaves.

    ``recall``: share of truly active neurons it marks active; ``predicted_active_fraction``:
    share of all neurons it marks active per token (true and false positives).
    """
    used: bool
    param_bytes: int = 0
    recall: float = 1.0
    predicted_active_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.used, bool):
            raise TandemError(f"predictor info: used must be a bool, got {self.used!r}")
        if isinstance(self.param_bytes, bool) or not isinstance(self.param_bytes, int) or self.param_bytes < 0:
            raise TandemError(f"predictor info: param_bytes must be an integer >= 0, got {self.param_bytes!r}")
        for key in ("recall", "predicted_active_fraction"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
                raise TandemError(f"predictor info: {key} must be in [0, 1], got {value!r}")


@dataclass(frozen=True)
class PredictorInfo:
    layers: tuple[LayerPredictorInfo, ...]
    fingerprint: str  # of the predictor artifact; NO_PREDICTORS_FINGERPRINT when there is none

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not all(isinstance(layer, LayerPredictorInfo) for layer in self.layers):
            raise TandemError("predictor info: layers must be LayerPredictorInfo entries")
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise TandemError("predictor info: fingerprint must be a non-empty string")

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def no_predictors(num_layers: int) -> PredictorInfo:
    """Every layer on the exact path (no predictor)."""
    return PredictorInfo(layers=tuple(LayerPredictorInfo(used=False) for _ in range(num_layers)),
                         fingerprint=NO_PREDICTORS_FINGERPRINT)


def load_predictor_info(predictors_dir: str | Path, num_layers: int, expected_model_fingerprint: str | None = None,
                        expected_profile_fingerprint: str | None = None) -> PredictorInfo:
    """Per-layer predictor facts (used flag, parameter bytes, recall, predicted-active fraction)
    from a ``tandem train-predictors`` artifact, with the artifact's fingerprint."""
    from predictors.artifact import load_predictors  # torch: loaded only when a plan reads predictors
    pset = load_predictors(predictors_dir, expected_model_fingerprint, expected_profile_fingerprint)
    if len(pset.entries) != num_layers:
        raise TandemError(f"predictors in {predictors_dir} cover {len(pset.entries)} layers, the model has {num_layers}")
    layers = []
    for entry in pset.entries:
        stats = entry.stats or {}
        used = bool(entry.use)
        layers.append(LayerPredictorInfo(
            used=used, param_bytes=4 * int(entry.param_count) if used else 0,
            recall=float(min(max(stats.get("recall", 1.0), 0.0), 1.0)) if used else 1.0,
            predicted_active_fraction=float(min(max(1.0 - stats.get("predicted_sparsity", 0.0), 0.0), 1.0)) if used else 1.0))
    return PredictorInfo(layers=tuple(layers), fingerprint=pset.meta["predictors_fingerprint"])
