"""build_predictors: calibration text -> trained, sized, end-to-end-checked PredictorSet.

Steps (each window of tokens a fresh context, as in the profiler):
1. collect the FFN inputs x of every layer on the calibration training split (the profiler's
   instrumentation, ``offline.collect``); the last ``val_fraction`` of those tokens is held out
   for early stopping, decision thresholds and the recall/precision figures;
2. per dense layer: labels from the profile's activity definition, the MLP predictor's rank
   ladder at the target recall (``train.fit_layer``); for SwiGLU-style layers also mode "gate";
3. options per layer: each mode at each recall level (the target, and 0.98 / 0.99 above it),
   kept when it does less work than the exact path (a gathered row counted at GATHERED_ROW_COST
   dense rows); each with its saved work and the relative
   FFN-output error its misses cause on held-out tokens;
4. end to end on the held-out documents: dense, the exact path everywhere, then options turned
   on best-first (least error per saved work; a later option of a layer replaces its earlier one)
   while the perplexity stays within the limit: max(profile budget, exact path + extra_loss);
5. MoE: the free next-layer expert guess, and trained guesses where it falls short.

Example::

    engine = Engine.load("smollm2")
    profile = load_profile("profiles/SmolLM2/profile", engine.model_fingerprint)
    pset = build_predictors(engine, profile, build_calibration_set(engine), TrainSettings())
    save_predictors(pset, "profiles/SmolLM2/predictors")
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tandem.core.ffn.weights import MoELayerWeights
from tandem.core.loading.deferred import DeferredTensor
from offline.calibration import DEFAULT_MAX_QUALITY_LOSS
from offline.collect import base_executor, iter_calibration_batches, split_windows
from tandem.core.errors import TandemError
from .evaluate import HeldOutScorer, Quality, choose_prefix
from .expert import fit_expert_predictors
from .gated import PredictorGatedExecutor
from .model import LayerEntry, PredictorSet
from .train import (GATHERED_ROW_COST, TrainSettings, first_projection_flops, fit_layer, gate_mode_applies, gate_scores, layer_labels,
                    miss_error, operating_point, predict_scores, up_scale_of)

DEFAULT_EXTRA_LOSS = 0.005  # perplexity increase allowed over the exact path when it already uses the budget
DEFAULT_EVAL_TOKENS = 4096
EXTRA_RECALL_LEVELS = (0.98, 0.99)
# A predicted (gathered) row costs more than a row of a whole-matrix pass: the fused step reads dense


@dataclass
class Option:
    """One way to run one layer: a mode at a recall level, with its measured figures."""
    layer: int
    entry: LayerEntry
    saved_share: float  # of the exact path's first-projection work, per token (predictor cost included)
    output_error: float  # relative squared FFN-output error of its misses (validation tokens)

    @property
    def harm_per_saving(self) -> float:
        return self.output_error / self.saved_share


def model_param_count(engine) -> int:
    """Parameters of the whole model (tied embeddings counted once)."""
    seen, total = set(), 0
    tensors = list(engine.model.parameters())
    for w in base_executor(engine).layers:
        ffns = [w] if not isinstance(w, MoELayerWeights) else [*w.experts, *([w.shared_expert] if w.shared_expert else [])]
        if isinstance(w, MoELayerWeights):
            tensors += [w.router] + ([w.shared_expert_gate] if w.shared_expert_gate is not None else [])
        tensors += [t for f in ffns for t in vars(f).values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        # a deferred weight has no storage of its own (each use decodes a new one): the object is its identity
        key = ("deferred", id(t)) if isinstance(t, DeferredTensor) else (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel()
    return total


def exact_thresholds(profile, num_layers: int) -> torch.Tensor:
    """Per-layer |h| thresholds of the exact path (zeros for ReLU-family profiles)."""
    if profile.activity == "relu":
        return torch.zeros(num_layers)
    return profile.thresholds.float()


def collect_inputs(engine, docs: list[list[int]], window_tokens: int, progress: bool = True) -> dict[int, torch.Tensor]:
    """{layer: x [N, d]} FFN inputs on the documents (the dense model; the profiler's instrumentation)."""
    xs: dict[int, list[torch.Tensor]] = {}
    n_windows = len(split_windows(docs, window_tokens))
    with tqdm(total=n_windows, desc="collect FFN inputs", unit="win", disable=not progress) as bar:
        for batch in iter_calibration_batches(engine, docs, window_tokens):
            for i, obs in batch.layers.items():
                xs.setdefault(i, []).append(obs.x)
            bar.update(1)
    return {i: torch.cat(v) for i, v in sorted(xs.items())}


def recall_levels(target: float) -> list[float]:
    return sorted({target, *(r for r in EXTRA_RECALL_LEVELS if r > target)})


def _point_stats(point) -> dict[str, float]:
    return {"recall": point.recall, "precision": point.precision, "predicted_sparsity": 1.0 - point.active_fraction}


def layer_options(cfg, w, layer: int, activity: str, x_tr, x_va, threshold: float, settings: TrainSettings,
                  bar=None) -> tuple[dict[str, Any], list[Option]]:
    """Train and measure one layer: (its report stats, its options that save work)."""
    y_tr, y_va = layer_labels(cfg, w, x_tr, threshold), layer_labels(cfg, w, x_va, threshold)
    proj_flops = first_projection_flops(cfg, w.n_neurons, activity)
    preactivation = (w.gate, w.gate_bias) if w.gate is not None else (w.up, w.up_bias)  # its sign decides firing
    fit = fit_layer(x_tr, y_tr, x_va, y_va, proj_flops, settings, progress=bar, preactivation=preactivation)
    stats: dict[str, Any] = {**_point_stats(fit.point), "rank": fit.rank, "trained_rank": fit.rank,
                             "trained_param_count": fit.predictor.param_count, "n_ff": w.n_neurons,
                             "label_sparsity": 1.0 - float(y_va.float().mean()), "tried": fit.tried}
    options: list[Option] = []
    mlp_scores = predict_scores(fit.predictor, x_va)  # [N, F]
    candidates = [("predictor", mlp_scores, fit.predictor.flops_per_token, proj_flops)]
    up_scale = None
    if gate_mode_applies(cfg, activity):
        up_scale = up_scale_of(w, x_tr)
        candidates.append(("gate", gate_scores(cfg, w, x_va, up_scale), 0, proj_flops // 2))
    for mode, scores, cost, skippable in candidates:
        for level in recall_levels(settings.target_recall):
            point = fit.point if (mode == "predictor" and level == settings.target_recall) else \
                operating_point(scores, y_va, level)
            saved = (skippable * (1.0 - GATHERED_ROW_COST * point.active_fraction) - cost) / proj_flops
            if saved <= 0:
                continue
            err = miss_error(cfg, w, x_va, scores >= point.threshold, threshold)
            entry = LayerEntry(mode=mode, predictor=fit.predictor if mode == "predictor" else None,
                               up_scale=up_scale if mode == "gate" else None, threshold=point.threshold,
                               stats={**stats, **_point_stats(point), "recall_level": level, "saved_share": saved,
                                      "output_error": err, "rank": fit.rank if mode == "predictor" else 0})
            options.append(Option(layer, entry, saved, err))
    return stats, options


def ordered_options(options: list[Option]) -> list[Option]:
    """Least harm per saved work first; within a layer, an option is kept only if it saves more
    than the ones before it (turning it on replaces them)."""
    best_saved: dict[int, float] = {}
    out = []
    for opt in sorted(options, key=lambda o: (o.harm_per_saving, -o.saved_share)):
        if opt.saved_share > best_saved.get(opt.layer, 0.0):
            best_saved[opt.layer] = opt.saved_share
            out.append(opt)
    return out


def build_predictors(engine, profile, calib, settings: TrainSettings, *, window_tokens: int | None = None,
                     val_fraction: float = 0.15, max_quality_loss: float | None = None,
                     extra_loss: float = DEFAULT_EXTRA_LOSS, eval_tokens: int = DEFAULT_EVAL_TOKENS,
                     progress: bool = True) -> PredictorSet:
    cfg, layers = engine.config, base_executor(engine).layers
    if profile.model_fingerprint != engine.model_fingerprint:
        raise TandemError(f"profile was made for another model ({profile.model_id}); run `tandem profile` for this model")
    if not 0.0 < val_fraction < 0.5:
        raise TandemError(f"held-out fraction must be in (0, 0.5), got {val_fraction}")
    budget = float(profile.quality.get("max_quality_loss", DEFAULT_MAX_QUALITY_LOSS)) if max_quality_loss is None else max_quality_loss
    if window_tokens is None:  # the profile's windows, so held-out figures compare with its own
        window_tokens = int(profile.calibration.get("window_tokens", 256))
    window_tokens = min(window_tokens, engine.max_context - 1)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    xs = collect_inputs(engine, calib.train, window_tokens, progress)
    timings["collect_s"] = time.perf_counter() - t0
    n_tokens = next(iter(xs.values())).shape[0]
    n_val = max(1, int(round(n_tokens * val_fraction)))
    if n_tokens - n_val < 16:
        raise TandemError(f"calibration training split is too small: {n_tokens} tokens (need at least 32)")
    x_tr = {i: x[:-n_val] for i, x in xs.items()}
    x_va = {i: x[-n_val:] for i, x in xs.items()}
    thresholds = exact_thresholds(profile, cfg.num_layers)

    t0 = time.perf_counter()
    entries: list[LayerEntry] = []
    options: list[Option] = []
    n_dense = sum(not isinstance(w, MoELayerWeights) for w in layers)
    with tqdm(total=n_dense, desc="train predictors", unit="layer", disable=not progress) as bar:
        for i, w in enumerate(layers):
            if isinstance(w, MoELayerWeights):
                entries.append(LayerEntry(stats={"kind": "moe"}))
                continue
            # decoded once for the layer's training and option checks (deferred weights decode on each use)
            stats, layer_opts = layer_options(cfg, w.decoded(), i, profile.activity, x_tr[i], x_va[i],
                                              float(thresholds[i]), settings, bar)
            stats["reason"] = "end-to-end quality over the limit" if layer_opts else "costs more work than the exact path"
            entries.append(LayerEntry(stats=stats))
            options += layer_opts
            bar.update(1)
    timings["train_s"] = time.perf_counter() - t0

    experts: dict[int, LayerEntry] = {}
    if cfg.is_moe:
        t0 = time.perf_counter()
        experts = fit_expert_predictors(cfg, layers, x_tr, x_va, settings)
        timings["experts_s"] = time.perf_counter() - t0
    del xs, x_tr, x_va

    t0 = time.perf_counter()
    pset = PredictorSet(entries, experts=experts)
    quality = select_options(engine, pset, thresholds, calib.held_out, ordered_options(options), budget, extra_loss,
                             window_tokens, eval_tokens, progress)
    timings["evaluate_s"] = time.perf_counter() - t0
    pset.meta.update(model_fingerprint=engine.model_fingerprint, model_id=engine.model_id,
                     profile_fingerprint=profile.fingerprint, activity=profile.activity,
                     target_recall=settings.target_recall, rank_ladder=list(settings.ranks),
                     recall_levels=recall_levels(settings.target_recall),
                     model_param_count=model_param_count(engine), quality=quality,
                     calibration={"train_tokens": n_tokens - n_val, "val_tokens": n_val,
                                  "held_out_tokens": quality["dense"]["tokens"], "window_tokens": window_tokens},
                     timings_s={k: round(v, 3) for k, v in timings.items()})
    return pset


def _state(order: list[Option], n: int) -> dict[int, LayerEntry]:
    """Per layer, the last of the first n options (later ones of a layer replace earlier ones)."""
    return {opt.layer: opt.entry for opt in order[:n]}


def select_options(engine, pset: PredictorSet, thresholds: torch.Tensor, held_out: list[list[int]],
                   order: list[Option], budget: float, extra_loss: float, window_tokens: int,
                   eval_tokens: int, progress: bool) -> dict[str, Any]:
    """Install the chosen options into ``pset``; returns the quality figures for the metadata."""
    cfg, layers = engine.config, base_executor(engine).layers
    scorer = HeldOutScorer(engine, held_out, window_tokens, max_tokens=eval_tokens)
    dense = scorer.dense
    oracle = scorer.score(PredictorGatedExecutor(cfg, layers, exact_thresholds=thresholds))
    limit = max(budget, oracle.increase_over(dense) + extra_loss)

    with tqdm(total=None, desc="end-to-end check", unit="eval", disable=not progress) as bar:
        def evaluate(n: int) -> Quality:
            bar.update(1)
            return scorer.score(PredictorGatedExecutor(cfg, layers, exact_thresholds=thresholds,
                                                       overrides=_state(order, n)))
        chosen, q, trials = choose_prefix(len(order), evaluate, dense, limit, progress=bar)
    for layer, entry in _state(order, chosen).items():
        entry.stats["reason"] = ""
        pset.entries[layer] = entry
    return {"max_quality_loss": budget, "extra_loss": extra_loss, "limit": limit,
            "dense": dense.to_dict(), "exact_path": oracle.to_dict(), "gated": q.to_dict(),
            "gated_increase": q.increase_over(dense), "exact_path_increase": oracle.increase_over(dense),
            "options_considered": len(order), "options_used": chosen,
            "order": [[o.layer, o.entry.mode, o.entry.stats["recall_level"]] for o in order], "trials": trials}


PREDICTORS_SUBDIR = "predictors"  # profiles/<model-id>/predictors


def calibration_files(profile, override: list[str] | None) -> list[str] | None:
    """The user's --calib files, else the profile's own calibration files, else None (shipped corpus)."""
    if override:
        return override
    if profile.calibration.get("kind") == "files":
        paths = [f["path"] for f in profile.calibration.get("files", [])]
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise TandemError(f"the profile was calibrated on {missing[0]}, which is gone; pass --calib FILE")
        return paths
    return None
