"""profile_model: calibration text through the instrumented dense model -> a Profile artifact.

Passes (each window of tokens is a fresh context):
1. training split, dense: mean |h| per neuron, |h| histograms (non-ReLU models), MoE routing stats,
   exact-zero counts (ReLU models);
2. non-ReLU models: held-out perplexity, dense, then with uniform-quantile thresholds found by
   bisection within the quality budget;
3. non-ReLU models: training split again, counting ``|h| > threshold`` per neuron.

Example::

    engine = Engine.load("smollm2")
    calib = build_calibration_set(engine)                    # offline.calibration
    profile = profile_model(engine, calib, max_quality_loss=0.02)
    save_profile(profile, "profiles/SmolLM2/profile")
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch
from tqdm import tqdm

from tandem.core.errors import TandemError
from .calibration import DEFAULT_MAX_QUALITY_LOSS, CalibrationSet, check_max_quality_loss, split_documents
from .draft_thresholds import DEFAULT_DRAFT_QUALITY_LOSS, DRAFT_SEARCH_STEPS
from .collect import InstrumentedExecutor, ObserverGroup, base_executor, run_windows, split_windows
from .moe_stats import ExpertObserver
from .neurons import NeuronObserver, hot_order, skew_fraction
from .profile_artifact import Profile
from .thresholds import (BINS_PER_OCTAVE, LOG2_MAX, LOG2_MIN, AbsHistogram, ThresholdedExecutor, ThresholdSearch,
                         search_uniform_sparsity, windows_perplexity)

DEFAULT_WINDOW_TOKENS = 256
# The threshold search aims at this share of the quality budget. Measured on SmolLM2: one set of
# thresholds reads +1.85% on the training windows and +1.55% held out (estimates carry ~±0.4% on
# a few thousand tokens), fp16 down rows move it by ~0.2-0.4%, and the fused decode step's int8
# activations add ~0.25%. The reserve keeps what generation actually does within the budget.
SEARCH_BUDGET_SHARE = 0.75
DEFAULT_SEARCH_STEPS = 7
SKEW_MASS = 0.8
HOT_SHARE = 0.2


def profile_model(engine, calib: CalibrationSet | Sequence[list[int]], *,
                  max_quality_loss: float = DEFAULT_MAX_QUALITY_LOSS,
                  window_tokens: int = DEFAULT_WINDOW_TOKENS, search_steps: int = DEFAULT_SEARCH_STEPS,
                  progress: bool = True, draft_quality_loss: float | None = DEFAULT_DRAFT_QUALITY_LOSS) -> Profile:
    """Profile ``engine``'s model on calibration documents (a CalibrationSet, or token-id documents
    that are split here: every 5th held out). Returns the Profile (not yet saved).
    ``draft_quality_loss``: budget of the looser draft thresholds (speculative self-drafting;
    offline/draft_thresholds.py) searched after the configured ones; None skips that search."""
    check_max_quality_loss(max_quality_loss)
    if search_steps < 1:
        raise TandemError(f"search steps must be >= 1, got {search_steps}")
    if draft_quality_loss is not None and not max_quality_loss < draft_quality_loss <= 10.0:
        raise TandemError(f"the draft quality budget must be above --max-quality-loss ({max_quality_loss}) and "
                          f"at most 10, got {draft_quality_loss}")
    if not isinstance(calib, CalibrationSet):
        train, held_out = split_documents(list(calib))
        calib = CalibrationSet(train, held_out, {"kind": "token_ids", "train_tokens": sum(map(len, train)),
                                                 "held_out_tokens": sum(map(len, held_out))})
    window_tokens = min(window_tokens, engine.max_context - 1)
    train_windows = split_windows(calib.train, window_tokens)
    held_windows = split_windows(calib.held_out, window_tokens)
    if not train_windows or not any(len(w) > 1 for w in held_windows):
        raise TandemError("calibration text is too short: need training text and at least 2 held-out tokens")
    cfg = engine.config
    base = base_executor(engine)
    relu = cfg.ffn_is_relu_sparse
    n_windows = (len(train_windows) + len(held_windows) * (1 if relu else 2)
                 + (0 if relu else len(train_windows) * (2 + search_steps)))
    draft_steps = 0 if relu or draft_quality_loss is None else DRAFT_SEARCH_STEPS
    n_windows += draft_steps * len(train_windows)
    timings: dict[str, float] = {}
    with tqdm(total=n_windows, desc="profile", unit="win", disable=not progress, leave=True) as bar:
        def tick(_ids: list[int]) -> None:
            bar.update(1)

        # pass 1: training split, dense
        bar.set_description("profile: collect")
        t0 = time.perf_counter()
        neurons = NeuronObserver(cfg)
        hist = None if relu else AbsHistogram(cfg.num_layers)
        experts = ExpertObserver(cfg, base.layers) if cfg.is_moe else None
        for _ in run_windows(engine, InstrumentedExecutor(base, ObserverGroup([neurons, hist, experts])),
                             train_windows, on_window=tick):
            pass
        timings["collect_s"] = time.perf_counter() - t0

        # pass 2: the threshold search (training windows) and held-out quality
        t0 = time.perf_counter()
        bar.set_description("profile: held-out dense" if relu else "profile: search")
        if relu:
            held_neurons = NeuronObserver(cfg)
            dense_ppl, scored = windows_perplexity(engine, InstrumentedExecutor(base, held_neurons), held_windows, tick)
            search = ThresholdSearch(0.0, torch.zeros(cfg.num_layers), dense_ppl, dense_ppl,
                                     held_neurons.layer_sparsity(), scored)
        else:
            # pick the sparsity on the training windows, then measure it once on held-out text: a
            # search on held-out text would report a selected (optimistic) number as the test result
            def shown(point) -> None:
                bar.set_description(f"profile: search {point.sparsity:.1%} -> {point.increase:+.2%}")
            selection = search_uniform_sparsity(engine, hist, train_windows, max_quality_loss * SEARCH_BUDGET_SHARE,
                                                search_steps, on_window=tick, on_point=shown)
            bar.set_description("profile: held-out check")
            dense_ppl, _ = windows_perplexity(engine, base, held_windows, tick)
            chosen = ThresholdedExecutor(base, selection.thresholds)
            sparse_ppl, scored = windows_perplexity(engine, chosen, held_windows, tick)
            search = ThresholdSearch(selection.quantile, selection.thresholds, dense_ppl, sparse_ppl,
                                     chosen.sparsity(), scored, selection.points, selection.increase)
        timings["quality_s"] = time.perf_counter() - t0
        draft = None
        if draft_steps:  # looser thresholds for the sparse self-drafter, searched above the chosen ones
            t0 = time.perf_counter()
            bar.set_description("profile: draft search")
            draft = search_uniform_sparsity(engine, hist, train_windows, draft_quality_loss, draft_steps,
                                            dense_perplexity=selection.dense_perplexity, on_window=tick,
                                            lowest_quantile=selection.quantile)
            if draft.quantile <= selection.quantile:
                draft = selection
            timings["draft_search_s"] = time.perf_counter() - t0

        # pass 3: activity counts at the adopted thresholds
        if not relu:
            t0 = time.perf_counter()
            bar.set_description("profile: count")
            neurons = NeuronObserver(cfg, search.thresholds)
            for _ in run_windows(engine, InstrumentedExecutor(base, neurons), train_windows, on_window=tick):
                pass
            timings["count_s"] = time.perf_counter() - t0
        bar.set_description("profile: done")
    profile = _assemble(engine, calib, neurons, hist, experts, search, max_quality_loss, window_tokens, timings)
    if draft is not None:
        profile.tensors["draft_thresholds"] = torch.maximum(draft.thresholds.float(), search.thresholds.float())
        profile.quality["draft"] = {"max_quality_loss": draft_quality_loss, "uniform_sparsity": round(draft.quantile, 6),
                                    "selection_perplexity_increase": round(draft.increase, 6),
                                    "selection": "bisection on the training windows above the chosen quantile"}
    return profile


def _assemble(engine, calib: CalibrationSet, neurons: NeuronObserver, hist: AbsHistogram | None,
              experts: ExpertObserver | None, search: ThresholdSearch, budget: float, window_tokens: int,
              timings: dict[str, float]) -> Profile:
    cfg = engine.config
    freq, mean_abs = neurons.frequency(), neurons.mean_abs()  # [L, F]
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    for i in moe_layers:  # MoE layers: neuron stats live in expert_neuron_freq
        freq[i], mean_abs[i] = 0.0, 0.0
    order = hot_order(freq, mean_abs)
    skew = skew_fraction(freq, SKEW_MASS)
    sparsity = neurons.layer_sparsity()
    tensors: dict[str, torch.Tensor] = {
        "neuron_freq": freq, "neuron_mean_abs": mean_abs, "hot_order": order,
        "thresholds": search.thresholds.float(), "layer_sparsity": sparsity,
        "held_out_sparsity": search.held_out_sparsity.float(), "neuron_skew": skew,
    }
    if hist is not None:
        tensors["abs_log2_histogram"] = hist.counts.float()
    if experts is not None:
        tensors.update(expert_freq=experts.frequency(), expert_coselect=experts.coselection(),
                       expert_repeat=experts.repeat_rate(), expert_kept=experts.kept_rate(),
                       spec_recall=experts.speculative_recall(), expert_neuron_freq=neurons.expert_frequency())
    layers = [_layer_summary(i, cfg.is_moe_layer(i), tensors) for i in range(cfg.num_layers)]
    dense_layers = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    quality = {
        "max_quality_loss": budget,
        "dense_perplexity": round(search.dense_perplexity, 6),
        "sparse_perplexity": round(search.sparse_perplexity, 6),
        "perplexity_increase": round(search.increase, 6),
        "selection": "none (exact zeros)" if cfg.ffn_is_relu_sparse else "bisection on the training windows",
        "search_target": None if cfg.ffn_is_relu_sparse else round(budget * SEARCH_BUDGET_SHARE, 6),
        "selection_perplexity_increase": round(search.increase if search.selection_increase is None
                                               else search.selection_increase, 6),
        "uniform_sparsity": None if cfg.ffn_is_relu_sparse else round(search.quantile, 6),
        "allocation": "exact zeros" if cfg.ffn_is_relu_sparse else "uniform quantile",
        "held_out_sparsity": round(float(search.held_out_sparsity.mean()), 6),
        "train_sparsity": round(float(sparsity.mean()), 6),
        "held_out_scored_tokens": search.scored_tokens,
        "search": [{"sparsity": round(p.sparsity, 6), "perplexity": round(p.perplexity, 6),
                    "increase": round(p.increase, 6)} for p in search.points],
    }
    skew_dense = [float(skew[i]) for i in dense_layers if not math.isnan(float(skew[i]))]
    calibration = dict(calib.source, window_tokens=window_tokens,
                       train_tokens=calib.train_tokens, held_out_tokens=calib.held_out_tokens)
    extra: dict[str, Any] = {
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "skew_mass": SKEW_MASS,
        "mean_skew": round(sum(skew_dense) / len(skew_dense), 6) if skew_dense else None,
        "histogram": {"log2_min": LOG2_MIN, "log2_max": LOG2_MAX, "bins_per_octave": BINS_PER_OCTAVE},
    }
    return Profile(model_fingerprint=engine.model_fingerprint, model_id=engine.model_id,
                   activity="relu" if cfg.ffn_is_relu_sparse else "threshold", tensors=tensors,
                   calibration=calibration, quality=quality, layers=layers, extra=extra)


def _layer_summary(i: int, is_moe: bool, t: dict[str, torch.Tensor]) -> dict[str, Any]:
    def num(x: torch.Tensor) -> float | None:
        v = float(x)
        return None if math.isnan(v) else round(v, 6)

    out: dict[str, Any] = {"layer": i, "kind": "moe" if is_moe else "dense", "threshold": num(t["thresholds"][i]),
                           "sparsity": num(t["layer_sparsity"][i]), "held_out_sparsity": num(t["held_out_sparsity"][i])}
    if not is_moe:
        f = torch.sort(t["neuron_freq"][i].double(), descending=True).values
        n_hot = max(1, round(HOT_SHARE * f.numel()))
        out.update(skew=num(t["neuron_skew"][i]), mean_freq=num(f.mean()),
                   hot20_share=num(f[:n_hot].sum() / f.sum()) if float(f.sum()) > 0 else None)
    else:
        ef = t["expert_freq"][i].double()
        out.update(expert_repeat=num(t["expert_repeat"][i]), expert_kept=num(t["expert_kept"][i]),
                   spec_recall_1=num(t["spec_recall"][i, 0]), spec_recall_2=num(t["spec_recall"][i, 1]),
                   top_expert_share=num(ef.max() / ef.sum()) if float(ef.sum()) > 0 else None)
    return out
