"""Draft thresholds: a second, looser set of per-layer FFN thresholds for the sparse self-drafter.

The profiler searches them like the configured ones, at a looser quality budget
(``DEFAULT_DRAFT_QUALITY_LOSS``, e.g. +20% perplexity), and stores them in the profile as the
``draft_thresholds`` tensor [L] with ``quality["draft"]``. A profile made before that has none:
``draft_thresholds`` then derives them from what the profile does hold (its |h| histogram and the
measured points of the main search: the sparsest point within the draft budget) and says so in
``source``.

Example::

    draft = draft_thresholds(load_profile(profile_dir))
    draft.thresholds, draft.source        # (0.031, ...), "profile" or "derived: ..."
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.core.errors import ArtifactError, TandemError
from .thresholds import AbsHistogram

DEFAULT_DRAFT_QUALITY_LOSS = 0.2
DRAFT_SEARCH_STEPS = 4


@dataclass(frozen=True)
class DraftThresholds:
    thresholds: tuple[float, ...]  # [L] |h| thresholds, each >= the configured one
    uniform_sparsity: float | None  # the uniform quantile they were cut at (None: unknown)
    quality_loss: float | None  # measured perplexity increase at them (None: not measured)
    source: str  # "profile" or "derived: <how>"

    def __post_init__(self) -> None:
        if not self.thresholds or not all(isinstance(t, float) and math.isfinite(t) and t >= 0
                                          for t in self.thresholds):
            raise ArtifactError("draft thresholds must be finite numbers >= 0, one per layer")
        if not self.source:
            raise ArtifactError("draft thresholds need a source")


def draft_thresholds(profile, max_quality_loss: float = DEFAULT_DRAFT_QUALITY_LOSS) -> DraftThresholds:
    """The profile's draft thresholds, or ones derived from an older profile (``source`` says which)."""
    n_layers = int(profile.thresholds.shape[0])
    base = [float(t) for t in profile.thresholds.tolist()]
    stored = profile.tensors.get("draft_thresholds")
    if stored is not None:
        if tuple(stored.shape) != (n_layers,):
            raise ArtifactError(f"profile draft_thresholds has shape {list(stored.shape)}, expected [{n_layers}]")
        info = profile.quality.get("draft", {})
        return DraftThresholds(tuple(max(float(t), b) for t, b in zip(stored.tolist(), base)),
                               info.get("uniform_sparsity"), info.get("selection_perplexity_increase"), "profile")
    if profile.activity == "relu":
        raise TandemError("no sparse drafter: this ReLU-family profile has exact zeros and no looser thresholds "
                          "(re-run `tandem profile` to search draft thresholds)")
    hist = profile.tensors.get("abs_log2_histogram")
    points = [p for p in profile.quality.get("search", []) if p.get("increase", math.inf) <= max_quality_loss]
    if hist is None or not points:
        raise TandemError("no sparse drafter: the profile has no draft thresholds and no histogram/search "
                          "points to derive them from (re-run `tandem profile`)")
    best = max(points, key=lambda p: p["sparsity"])
    observer = AbsHistogram(n_layers)
    if tuple(hist.shape) != tuple(observer.counts.shape):
        raise ArtifactError(f"profile histogram has shape {list(hist.shape)}, expected {list(observer.counts.shape)}")
    observer.counts = hist.double()
    derived = observer.quantile_thresholds(float(best["sparsity"]))  # [L]
    return DraftThresholds(tuple(max(float(t), b) for t, b in zip(derived.tolist(), base)), float(best["sparsity"]),
                           float(best["increase"]),
                           f"derived: this profile predates draft thresholds; the sparsest measured search point "
                           f"within +{max_quality_loss:.0%} ({best['sparsity']:.1%} sparsity, "
                           f"{best['increase']:+.1%} perplexity)")
