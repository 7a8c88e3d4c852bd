"""Next-token selection over numpy logits: the torch-free generate path (online.execution.native_step).

The same distribution as tandem.core.sampling.sampling_probs (temperature, then top-k, then top-p,
the first token always kept) and the same greedy choice (the first index of the maximum, as
``torch.argmax``). Sampled draws come from numpy's generator, as the torch path's do
(tandem.core.sampling.make_generator), so a seed gives the same text on both.

Example::

    rng = make_rng(SamplingParams(seed=1))
    token = sample_next_np(logits, SamplingParams(temperature=0.7, top_p=0.9), rng)   # logits: [vocab] float32
"""
from __future__ import annotations

import numpy as np

from .sampling_params import SamplingParams


def make_rng(params: SamplingParams) -> np.random.Generator:
    return np.random.default_rng(params.seed)


def sampling_probs_np(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[vocab] float64 probabilities ``sample_next_np`` draws from (one-hot of the argmax when greedy)."""
    if params.greedy:
        out = np.zeros(logits.shape[-1], dtype=np.float64)
        out[int(np.argmax(logits))] = 1.0
        return out
    scores = logits.astype(np.float32) / np.float32(params.temperature)  # [vocab]
    if params.top_k and params.top_k < scores.shape[0]:
        kth = np.partition(scores, -params.top_k)[-params.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if params.top_p < 1.0:
        order = np.argsort(-scores, kind="stable")  # descending
        probs_sorted = _softmax(scores[order])
        drop = np.cumsum(probs_sorted) - probs_sorted >= params.top_p  # [vocab]
        drop[0] = False  # the first token always stays
        scores = scores.copy()
        scores[order[drop]] = -np.inf
    return _softmax(scores)


def sample_next_np(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits [vocab] -> token id."""
    if params.greedy:
        return int(np.argmax(logits))
    return draw_index(sampling_probs_np(logits, params), rng)


def draw_index(probs: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn from ``probs`` [vocab] (float64, need not sum to 1): the inverse CDF at one uniform draw."""
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(probs) - 1))


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x.astype(np.float64) - np.max(x))
    return z / z.sum()
