"""The predictor artifact: ``DIR/predictors.safetensors`` + ``DIR/predictors.json``.

Tensors: ``layer.{i}.{down,up}.{weight,bias}`` for layers in mode "predictor",
``layer.{i}.up_scale`` for layers in mode "gate", and ``expert.{i}.*`` for MoE layers with a
trained next-layer expert predictor.

JSON: kind "predictors", schema version, model and profile fingerprints, the profile's activity,
per layer ``mode``, ``use``, ``rank``, ``threshold``, ``recall``, ``precision``,
``predicted_sparsity``, ``param_count`` (and why a layer is not used), the total predictor size
as a share of the model, the end-to-end quality numbers, and ``predictors_fingerprint`` (what
plans built from it record).

Example::

    save_predictors(pset, "profiles/SmolLM2/predictors")
    pset = load_predictors("profiles/SmolLM2/predictors", expected_model_fingerprint=engine.model_fingerprint,
                           expected_profile_fingerprint=profile.fingerprint)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tandem.core.artifacts import CHECKSUM_KEY, fingerprint, load_artifact, save_artifact
from tandem.core.errors import ArtifactError, TandemError
from .model import LayerEntry, LayerPredictor, PredictorSet

PREDICTORS_SCHEMA_VERSION = 1
ARTIFACT_NAME = "predictors"
LAYER_KEYS = ("mode", "rank", "threshold", "recall", "precision", "predicted_sparsity", "param_count", "use")


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> list:
    return sorted((k, list(v.shape), round(float(v.double().sum()), 6)) for k, v in tensors.items())


def predictors_fingerprint(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    body = {k: v for k, v in meta.items() if k not in ("predictors_fingerprint", CHECKSUM_KEY)}  # (save adds that)
    return fingerprint({"meta": body, "tensors": _tensor_digest(tensors)})


def _builtin(v: Any) -> Any:
    if hasattr(v, "item"):  # numpy / torch scalars
        return v.item()
    raise TypeError(f"cannot store {type(v).__name__} in predictor metadata")


def _plain(meta: dict[str, Any]) -> dict[str, Any]:
    """JSON-normal form (what loading gives back), so the fingerprint survives the round trip."""
    try:
        return json.loads(json.dumps(meta, default=_builtin, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TandemError(f"predictor metadata is not storable: {e}") from None


def _layer_meta(i: int, e: LayerEntry) -> dict[str, Any]:
    row = dict(e.stats)
    row.update(layer=i, mode=e.mode, use=e.use, threshold=float(e.threshold), param_count=e.param_count,
               rank=e.predictor.rank if e.predictor is not None else 0)
    row.setdefault("trained_rank", row["rank"])
    for key in ("recall", "precision", "predicted_sparsity"):
        row.setdefault(key, None)
    return row


def to_artifact(pset: PredictorSet) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The (tensors, meta) pair written for ``pset``; ``pset.meta`` supplies fingerprints and figures."""
    for key in ("model_fingerprint", "profile_fingerprint", "model_id"):
        if key not in pset.meta:
            raise TandemError(f"predictor set metadata lacks {key}")
    tensors: dict[str, torch.Tensor] = {}
    for i, e in enumerate(pset.entries):
        if e.mode == "predictor":
            tensors.update(e.predictor.state_tensors(f"layer.{i}"))
        elif e.mode == "gate":
            tensors[f"layer.{i}.up_scale"] = e.up_scale.detach().float().contiguous()
    for i, e in pset.experts.items():
        if e.predictor is not None:
            tensors.update(e.predictor.state_tensors(f"expert.{i}"))
    meta = {k: v for k, v in pset.meta.items() if k not in ("layers", "experts")}
    meta.update(kind="predictors", schema_version=PREDICTORS_SCHEMA_VERSION,
                layers=[_layer_meta(i, e) for i, e in enumerate(pset.entries)],
                experts=[_layer_meta(i, e) for i, e in sorted(pset.experts.items())],
                total_param_count=pset.param_count)
    model_params = meta.get("model_param_count")
    if model_params:
        meta["share_of_model"] = pset.param_count / model_params
    meta = _plain(meta)
    meta["predictors_fingerprint"] = predictors_fingerprint(meta, tensors)
    return tensors, meta


def save_predictors(pset: PredictorSet, out_dir: str | Path) -> Path:
    """Write the artifact atomically (an interrupted run leaves no half artifact)."""
    tensors, meta = to_artifact(pset)
    pset.meta["predictors_fingerprint"] = meta["predictors_fingerprint"]
    return save_artifact(out_dir, ARTIFACT_NAME, tensors, meta)


def _entry(tensors: dict[str, torch.Tensor], prefix: str, row: dict[str, Any], where: str) -> LayerEntry:
    missing = [k for k in LAYER_KEYS if k not in row]
    if missing:
        raise ArtifactError(f"{where}: layer entry lacks {', '.join(missing)}")
    pred = scale = None
    mode = row["mode"]
    try:
        if mode == "predictor":
            pred = LayerPredictor.from_tensors(tensors, prefix)
            if pred.rank != row["rank"]:
                raise TandemError(f"{prefix} has rank {pred.rank}, metadata says {row['rank']}")
        elif mode == "gate":
            scale = tensors.get(f"{prefix}.up_scale")
            if scale is None or scale.dim() != 1:
                raise TandemError(f"{prefix} is in mode 'gate' but has no up_scale vector")
        stats = {k: v for k, v in row.items() if k not in ("mode", "use", "threshold", "layer")}
        entry = LayerEntry(mode=mode, predictor=pred, up_scale=scale, threshold=float(row["threshold"]), stats=stats)
    except TandemError as e:
        raise ArtifactError(f"{where}: {e}") from None
    if entry.use != bool(row["use"]):
        raise ArtifactError(f"{where}: {prefix} has mode {mode!r} but use={row['use']}")
    return entry


def load_predictors(art_dir: str | Path, expected_model_fingerprint: str | None,
                    expected_profile_fingerprint: str | None = None) -> PredictorSet:
    """Load and validate; refuse predictors made for another model or another profile."""
    tensors, meta = load_artifact(art_dir, ARTIFACT_NAME, kind="predictors", schema_version=PREDICTORS_SCHEMA_VERSION)
    where = f"predictors in {art_dir}"
    for key in ("model_fingerprint", "profile_fingerprint", "layers", "predictors_fingerprint"):
        if key not in meta:
            raise ArtifactError(f"{where}: metadata lacks {key}")
    if expected_model_fingerprint is not None and meta["model_fingerprint"] != expected_model_fingerprint:
        raise ArtifactError(f"{where} were trained for another model ({meta.get('model_id')}, fingerprint "
                            f"{meta['model_fingerprint']}, this model is {expected_model_fingerprint}); "
                            f"run `tandem train-predictors` for this model")
    if expected_profile_fingerprint is not None and meta["profile_fingerprint"] != expected_profile_fingerprint:
        raise ArtifactError(f"{where} were trained from another profile (fingerprint {meta['profile_fingerprint']}, "
                            f"expected {expected_profile_fingerprint}); rerun `tandem train-predictors`")
    if predictors_fingerprint(meta, tensors) != meta["predictors_fingerprint"]:
        raise ArtifactError(f"{where} are corrupted: their content does not match their fingerprint")
    if not isinstance(meta["layers"], list):
        raise ArtifactError(f"{where}: 'layers' must be a list")
    entries = [_entry(tensors, f"layer.{i}", row, where) for i, row in enumerate(meta["layers"])]
    experts = {int(row["layer"]): _entry(tensors, f"expert.{row['layer']}", row, where)
               for row in meta.get("experts", [])}
    body = {k: v for k, v in meta.items() if k not in ("layers", "experts")}
    return PredictorSet(entries, meta=body, experts=experts)
