"""Greedy baseline: fill the GPU budget with the units that save the most modeled time per byte.

It ignores that a layer's GPU and CPU FFN parts overlap (it adds up savings), which is exactly
what the ILP accounts for; the plan reports how much better the ILP does under the cost model.
A layer's first FFN chunks are offered as one block holding ``min_gpu_neurons`` neurons, so the
minimum-or-none rule always holds.

Example::

    placement = greedy_placement(problem)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .cost_model import Placement, all_cpu_placement
from .problem import PlacementProblem


@dataclass(frozen=True)
class _Candidate:
    kind: str  # attention | predictor | chunks | experts | shared | head | embeddings
    layer: int
    first: int  # chunks: first chunk index; experts: option index before
    last: int  # chunks: one past the last chunk; experts: option index after
    gpu_bytes: int
    saved_s: float
    rank: float = 0.0  # seconds saved per byte, made non-increasing along a layer's chain of chunks/experts

    @property
    def density(self) -> float:
        return math.inf if self.gpu_bytes <= 0 else self.saved_s / self.gpu_bytes


def _candidates(problem: PlacementProblem) -> list[_Candidate]:
    found = []
    for i, layer in enumerate(problem.layers):
        found.append(_Candidate("attention", i, 0, 0, layer.attention.gpu_bytes, layer.attention.cpu_s - layer.attention.gpu_s))
        if layer.predictor is not None:
            found.append(_Candidate("predictor", i, 0, 0, layer.predictor.gpu_bytes, layer.predictor.cpu_s - layer.predictor.gpu_s))
        if layer.is_moe:
            pinned_only = sorted((o.pinned_count, k) for k, o in enumerate(layer.expert_options) if o.cache_slots == 0)
            for (_, before), (_, after) in zip(pinned_only, pinned_only[1:]):
                a, b = layer.expert_options[before], layer.expert_options[after]
                found.append(_Candidate("experts", i, before, after, b.gpu_bytes - a.gpu_bytes,
                                        (a.gpu_s + a.cpu_s) - (b.gpu_s + b.cpu_s)))
            if layer.shared_expert is not None:
                unit = layer.shared_expert
                found.append(_Candidate("shared", i, 0, 0, unit.gpu_bytes, unit.cpu_s - unit.gpu_s))
            continue
        saved = layer.chunk_cpu_s - layer.chunk_gpu_s
        first_block = int(np.searchsorted(np.cumsum(layer.chunk_sizes), layer.min_gpu_neurons)) + 1
        first_block = min(max(first_block, 1), layer.num_chunks)
        if layer.min_gpu_neurons == 0:
            first_block = 1
        found.append(_Candidate("chunks", i, 0, first_block, int(layer.chunk_gpu_bytes[:first_block].sum()),
                                float(saved[:first_block].sum())))
        for c in range(first_block, layer.num_chunks):
            found.append(_Candidate("chunks", i, c, c + 1, int(layer.chunk_gpu_bytes[c]), float(saved[c])))
    found.append(_Candidate("head", -1, 0, 0, problem.output_head.gpu_bytes,
                            problem.output_head.cpu_s - problem.output_head.gpu_s))
    if problem.embeddings is not None:
        found.append(_Candidate("embeddings", -1, 0, 0, problem.embeddings.gpu_bytes,
                                problem.embeddings.cpu_s - problem.embeddings.gpu_s))
    ranked, chain_floor = [], {}
    for cand in found:  # chains (chunks, experts) are listed in order: a link never outranks its predecessor
        key = (cand.kind, cand.layer) if cand.kind in ("chunks", "experts") else None
        rank = min(cand.density, chain_floor.get(key, math.inf))
        if key is not None:
            chain_floor[key] = rank
        ranked.append(dataclasses.replace(cand, rank=rank))
    return ranked


def greedy_placement(problem: PlacementProblem) -> Placement:
    """Units in order of modeled seconds saved per GPU byte, while they fit (see the module docstring)."""
    placement = all_cpu_placement(problem)
    free_bytes = problem.capacity_bytes
    if free_bytes <= 0 or not problem.hardware.has_gpu:
        return placement
    order = sorted(_candidates(problem), key=lambda c: (-c.rank, c.layer, c.first))
    for cand in order:
        if cand.saved_s <= 0 or cand.gpu_bytes > free_bytes:
            continue
        i = cand.layer
        if cand.kind == "chunks":
            chunks = placement.gpu_chunks[i]
            if cand.first > 0 and not chunks[cand.first - 1]:
                continue  # keep hot-first order and the minimum block
            chunks[cand.first:cand.last] = True
        elif cand.kind == "experts":
            if placement.expert_option[i] != cand.first:
                continue  # pin in popularity order
            placement.expert_option[i] = cand.last
        elif cand.kind == "attention":
            placement.attention_on_gpu[i] = True
        elif cand.kind == "predictor":
            placement.predictor_on_gpu[i] = True
        elif cand.kind == "shared":
            placement.shared_expert_on_gpu[i] = True
        elif cand.kind == "head":
            placement.output_head_on_gpu = True
            placement.embeddings_on_gpu = placement.embeddings_on_gpu or problem.embeddings is None
        elif cand.kind == "embeddings":
            placement.embeddings_on_gpu = True
        free_bytes -= cand.gpu_bytes
    return placement
