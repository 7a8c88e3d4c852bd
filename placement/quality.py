"""Quality that travels with a plan: held-out perplexity and greedy agreement with dense, measured
through the runtime the plan describes (its formats, tier placement, thresholds and predictors).

``tandem plan`` measures it right after planning (``--no-quality`` skips it) on a small held-out
slice (the profile's calibration split: every 5th document of the built-in corpus) and records it in
``plan.json`` under ``quality``; ``show-plan`` prints it and loading a plan whose recorded perplexity
increase is above the profile's quality budget warns.

Example::

    quality = measure_plan_quality("smollm2", "profiles/m/plan-rtx4090-2GiB", max_tokens=256)
    quality["perplexity_increase"], quality["greedy_agreement"]
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem.core.errors import TandemError

DEFAULT_QUALITY_TOKENS = 256
WINDOW_TOKENS = 128


def held_out_tokens(engine, max_tokens: int, token_docs: list[list[int]] | None = None) -> list[int]:
    """The held-out slice: the calibration split's held-out documents (or ``token_docs``), concatenated."""
    if token_docs is None:
        from offline.calibration import build_calibration_set
        token_docs = build_calibration_set(engine, max_tokens=max(16, 5 * max_tokens)).held_out
    flat = [t for doc in token_docs for t in doc][:max_tokens]
    if len(flat) < 2:
        raise TandemError("the held-out slice for plan quality has fewer than 2 tokens")
    return flat


def _scores(engine, tokens: list[int], window_tokens: int) -> tuple[float, torch.Tensor]:
    """Sum of NLL over scored positions and the greedy choices there (windows of ``window_tokens``, no overlap)."""
    nll, greedy = 0.0, []
    for begin in range(0, len(tokens) - 1, window_tokens):
        window = tokens[begin:begin + window_tokens + 1]
        logits = engine.logits(window)[:-1]  # [W, vocab], predicting window[1:]
        targets = torch.tensor(window[1:])
        nll -= float(F.log_softmax(logits.double(), dim=-1).gather(1, targets[:, None]).sum())
        greedy.append(logits.argmax(dim=-1))
    return nll, torch.cat(greedy)


def measure_plan_quality(model: str | Path, plan_dir: str | Path, *, max_tokens: int = DEFAULT_QUALITY_TOKENS,
                         gpu_device: str | None = None, token_docs: list[list[int]] | None = None,
                         max_quality_loss: float | None = None, profile_dir: str | Path | None = None,
                         predictors_dir: str | Path | None = None) -> dict[str, Any]:
    """Perplexity of the plan's runtime and of dense float32 on the same held-out tokens, and how often
    their greedy next-token choices agree."""
    from online import Engine
    from .plan import read_plan
    context = read_plan(plan_dir).settings.context_tokens  # the KV cache the plan sized
    dense = Engine.load(str(model))
    window = max(1, min(WINDOW_TOKENS, context - 1, dense.max_context - 1))
    tokens = held_out_tokens(dense, max_tokens, token_docs)
    dense_nll, dense_greedy = _scores(dense, tokens, window)
    del dense
    planned = Engine.load(str(model), plan=plan_dir, gpu_device=gpu_device, profile=profile_dir, predictors=predictors_dir)
    plan_nll, plan_greedy = _scores(planned, tokens, window)
    scored = len(tokens) - 1
    ppl, dense_ppl = math.exp(plan_nll / scored), math.exp(dense_nll / scored)
    return {"label": "measured", "held_out_tokens": scored, "perplexity": round(ppl, 6),
            "dense_perplexity": round(dense_ppl, 6), "perplexity_increase": round(ppl / dense_ppl - 1.0, 6),
            "greedy_agreement": round(float((plan_greedy == dense_greedy).float().mean()), 6),
            "max_quality_loss": max_quality_loss, "window_tokens": window, "tier_device": str(planned.executor.tier.device),
            "path": "batched module path (tier units, packed CPU weights, thresholds, predictors)"}


def quality_warning(quality: dict[str, Any]) -> str | None:
    """A one-line warning when the recorded quality is outside its budget, else None."""
    budget = quality.get("max_quality_loss") if quality else None
    increase = quality.get("perplexity_increase") if quality else None
    if budget is None or increase is None or increase <= budget:
        return None
    return (f"this plan's measured held-out perplexity is {increase:.1%} above dense "
            f"(budget {budget:.1%}; greedy agreement {quality.get('greedy_agreement', float('nan')):.1%})")
