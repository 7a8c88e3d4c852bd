"""The profile artifact: ``DIR/profile.safetensors`` + ``DIR/profile.json``.

Tensors (L = layers, F = FFN neurons per layer, E = experts; MoE tensors only for MoE models):
    neuron_freq      [L, F] float32  fraction of calibration tokens where the neuron is active
    neuron_mean_abs  [L, F] float32  mean |h| (h = input of the down projection)
    hot_order        [L, F] int64    neuron indices, hottest first
    thresholds       [L]    float32  |h| threshold defining "active" (0 for ReLU-family models)
    layer_sparsity   [L]    float32  achieved fraction of inactive neurons on calibration text
    expert_freq      [L, E] float32  fraction of tokens routed to each expert (0 rows for dense layers)
    expert_coselect  [L, E, E] float32  co-selection counts
    expert_repeat    [L]    float32  how often a token's top-k set equals the previous token's
    spec_recall      [L, 2] float32  next-layer expert recall from this layer's hidden state, 1 and 2 ahead

Example::

    profile = load_profile("profiles/SmolLM2/profile", expected_model_fingerprint=ckpt.fingerprint)
    profile.neuron_freq.shape  # [30, 1536]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.core.artifacts import fingerprint, load_artifact, save_artifact
from tandem.core.errors import ArtifactError

PROFILE_SCHEMA_VERSION = 2  # 2: thresholds searched on training windows, held-out re-measured
TENSOR_KEYS = ("neuron_freq", "neuron_mean_abs", "hot_order", "thresholds", "layer_sparsity")
MOE_TENSOR_KEYS = ("expert_freq", "expert_coselect", "expert_repeat", "spec_recall")


@dataclass
class Profile:
    model_fingerprint: str
    model_id: str
    activity: str  # "relu": exact zeros; "threshold": |h| > per-layer threshold
    tensors: dict[str, torch.Tensor]
    calibration: dict[str, Any] = field(default_factory=dict)  # source, tokens, held-out tokens
    quality: dict[str, Any] = field(default_factory=dict)  # budget, dense/sparse perplexity
    layers: list[dict[str, Any]] = field(default_factory=list)  # per-layer summaries
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.activity not in ("relu", "threshold"):
            raise ArtifactError(f"profile activity must be 'relu' or 'threshold', got {self.activity!r}")
        missing = [k for k in TENSOR_KEYS if k not in self.tensors]
        if missing:
            raise ArtifactError(f"profile is missing tensors: {', '.join(missing)}")

    @property
    def neuron_freq(self) -> torch.Tensor:  # [L, F]
        return self.tensors["neuron_freq"]

    @property
    def thresholds(self) -> torch.Tensor:  # [L]
        return self.tensors["thresholds"]

    @property
    def is_moe(self) -> bool:
        return "expert_freq" in self.tensors

    @property
    def fingerprint(self) -> str:
        """Identifies this profile's content (used by predictors and plans built from it)."""
        return fingerprint({"model": self.model_fingerprint, "activity": self.activity,
                            "calibration": self.calibration, "quality": self.quality,
                            "thresholds": [round(float(t), 7) for t in self.thresholds.tolist()],
                            "freq_sum": round(float(self.neuron_freq.double().sum()), 4)})

    def to_meta(self) -> dict[str, Any]:
        return {"kind": "profile", "schema_version": PROFILE_SCHEMA_VERSION,
                "model_fingerprint": self.model_fingerprint, "model_id": self.model_id,
                "activity": self.activity, "calibration": self.calibration, "quality": self.quality,
                "layers": self.layers, "extra": self.extra, "profile_fingerprint": self.fingerprint}


def save_profile(profile: Profile, out_dir: str | Path, extra_files: dict[str, bytes] | None = None) -> Path:
    return save_artifact(out_dir, "profile", profile.tensors, profile.to_meta(), extra_files)


def load_profile(profile_dir: str | Path, expected_model_fingerprint: str | None = None) -> Profile:
    """Load and validate a profile; refuse one made for another model."""
    tensors, meta = load_artifact(profile_dir, "profile", kind="profile", schema_version=PROFILE_SCHEMA_VERSION)
    try:
        profile = Profile(model_fingerprint=meta["model_fingerprint"], model_id=meta["model_id"],
                          activity=meta["activity"], tensors=tensors, calibration=meta.get("calibration", {}),
                          quality=meta.get("quality", {}), layers=meta.get("layers", []), extra=meta.get("extra", {}))
    except KeyError as e:
        raise ArtifactError(f"profile metadata in {profile_dir} lacks {e}") from None
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type (an edited profile.json)
        raise ArtifactError(f"profile metadata in {profile_dir} is malformed: {e}") from None
    if not isinstance(profile.layers, list) or not all(isinstance(layer, dict) and type(layer.get("layer")) is int
                                                       for layer in profile.layers):
        raise ArtifactError(f"profile metadata in {profile_dir} is malformed: layers must be a list of objects "
                            "with a layer index")
    if meta.get("profile_fingerprint") != profile.fingerprint:
        raise ArtifactError(f"profile in {profile_dir} is corrupted: its content does not match its fingerprint")
    if expected_model_fingerprint is not None and profile.model_fingerprint != expected_model_fingerprint:
        raise ArtifactError(f"profile in {profile_dir} was made for another model "
                            f"({profile.model_id}, fingerprint {profile.model_fingerprint}); "
                            f"run `tandem profile` for this model")
    return profile
