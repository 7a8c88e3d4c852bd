"""End-to-end quality of predictor-gated FFNs on held-out text: perplexity and greedy agreement.

Every executor is scored on the same windows (each a fresh context) against the dense model:
perplexity of the text, and the share of positions whose greedy next token (argmax) equals the
dense model's. ``choose_prefix`` finds the largest prefix of a best-first list of options that
stays within the quality limit (bisection).

Example::

    scorer = HeldOutScorer(engine, held_out_ids, window_tokens=256)
    dense = scorer.dense                        # Quality(perplexity=..., agreement=1.0, ...)
    oracle = scorer.score(PredictorGatedExecutor(cfg, layers, exact_thresholds=profile.thresholds))
    gated = scorer.score(PredictorGatedExecutor(cfg, layers, pset, profile.thresholds))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from offline.collect import split_windows
from tandem.core.generate import prefill
from tandem.core.kv_cache import KVCache
from tandem.core.errors import TandemError
from .gated import PredictorGatedExecutor


@dataclass
class Quality:
    perplexity: float
    agreement: float  # share of positions whose argmax equals the dense model's
    tokens: int  # scored positions
    gate_up_fraction: float = 1.0  # share of gate and up rows computed (over dense FFN layers)
    up_fraction: float = 1.0  # share of up rows computed
    down_fraction: float = 1.0  # share of down-projection rows computed

    def increase_over(self, ref: "Quality") -> float:
        return self.perplexity / ref.perplexity - 1.0

    def to_dict(self) -> dict:
        return {"perplexity": self.perplexity, "agreement": self.agreement, "tokens": self.tokens,
                "gate_up_fraction": self.gate_up_fraction, "up_fraction": self.up_fraction,
                "down_fraction": self.down_fraction}


def split_into_windows(docs: Sequence[Sequence[int]] | Sequence[int], window_tokens: int) -> list[list[int]]:
    """Documents (or one flat id list) concatenated and cut into windows of window_tokens (>= 2 each),
    as the profiler cuts its held-out text."""
    return [w for w in split_windows(docs, window_tokens) if len(w) >= 2]


class HeldOutScorer:
    """Scores executors on fixed held-out windows; the dense reference is computed once."""

    def __init__(self, engine, token_ids: Sequence[Sequence[int]] | Sequence[int], window_tokens: int = 256,
                 max_tokens: int | None = None) -> None:
        if window_tokens < 2:
            raise TandemError(f"window must hold at least 2 tokens, got {window_tokens}")
        self.engine = engine
        window_tokens = min(window_tokens, engine.max_context - 1)
        windows = split_into_windows(token_ids, window_tokens)
        if max_tokens is not None:
            windows = split_into_windows(sum(windows, [])[:max_tokens], window_tokens)
        if not windows:
            raise TandemError("held-out text is too short to score (need at least 2 tokens)")
        self.windows = windows
        self.cache = KVCache(engine.config, max(len(w) for w in windows))
        self.dense_argmax: list[torch.Tensor] = []
        self.dense = self._run(engine.executor, keep_argmax=True)

    def _run(self, executor, keep_argmax: bool = False) -> Quality:
        nll, agree, scored = 0.0, 0, 0
        for i, ids in enumerate(self.windows):
            logits = prefill(self.engine.model, executor, self.cache, ids, all_logits=True)[:-1]  # [W-1, vocab]
            targets = torch.tensor(ids[1:])
            nll += float(F.cross_entropy(logits.double(), targets, reduction="sum"))
            top = logits.argmax(dim=-1)  # [W-1]
            if keep_argmax:
                self.dense_argmax.append(top)
            agree += int((top == self.dense_argmax[i]).sum())
            scored += len(ids) - 1
        stats = executor.stats() if isinstance(executor, PredictorGatedExecutor) else {}
        return Quality(perplexity=math.exp(nll / scored), agreement=agree / scored, tokens=scored,
                       gate_up_fraction=stats.get("gate_up_fraction", 1.0),
                       up_fraction=stats.get("up_fraction", 1.0), down_fraction=stats.get("down_fraction", 1.0))

    def score(self, executor) -> Quality:
        if isinstance(executor, PredictorGatedExecutor):
            executor.reset_stats()
        return self._run(executor)


def choose_prefix(n_options: int, evaluate: Callable[[int], Quality], dense: Quality, max_increase: float,
                  progress=None) -> tuple[int, Quality, list[dict]]:
    """Largest n in 0..n_options whose ``evaluate(n)`` (the first n options on) stays within
    ``max_increase`` perplexity over dense; bisection, assuming harm grows with n and n = 0 (the
    exact path) is acceptable. Returns (n, its quality, the trials made)."""
    trials: list[dict] = []
    cache: dict[int, Quality] = {}

    def quality(n: int) -> Quality:
        if n not in cache:
            cache[n] = evaluate(n)
            inc = cache[n].increase_over(dense)
            trials.append({"options": n, "increase": inc, "agreement": cache[n].agreement,
                           "gate_up_fraction": cache[n].gate_up_fraction, "ok": inc <= max_increase})
            if progress is not None:
                progress.set_postfix_str(f"{n} options on: {inc:+.2%}", refresh=True)
        return cache[n]

    lo, hi = 0, n_options
    if hi and quality(hi).increase_over(dense) <= max_increase:
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if quality(mid).increase_over(dense) <= max_increase:
            lo = mid
        else:
            hi = mid
    return lo, quality(lo), trials
