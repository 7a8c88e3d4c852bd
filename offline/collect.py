"""Instrumented FFN execution: per-layer observations (FFN input, hidden h, routing) during a forward pass.

The model calls ``executor.forward(layer, x)`` for each FFN/MoE block; :class:`InstrumentedExecutor`
computes exactly what :class:`~tandem.core.ffn.DenseExecutor` computes and hands every layer's
:class:`LayerObservation` to an observer (any object with ``observe(obs)``). Subclasses may
sparsify the hidden state through :meth:`InstrumentedExecutor.transform_hidden` (see
``offline.thresholds.ThresholdedExecutor``); observers always see the dense h.

Two helpers give training data to other components (predictor trainers, profilers):

- :func:`iter_calibration_batches` streams one :class:`CalibrationBatch` per window of tokens,
- :func:`collect_layer_activations` concatenates them: ``{layer: (x [N, d], h [N, F])}``.

Example::

    from online import Engine
    from offline.collect import collect_layer_activations, iter_calibration_batches

    engine = Engine.load("smollm2")
    ids = engine.tokenizer.encode("Some calibration text ...")
    acts = collect_layer_activations(engine, ids, layers=[0, 5], window_tokens=256)
    x0, h0 = acts[0]                      # x0 [N, 576] FFN input, h0 [N, 1536] = silu(gate)*up
    for batch in iter_calibration_batches(engine, ids, window_tokens=256):
        batch.layers[5].h                 # [T, 1536] for this window
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Protocol, Sequence

import torch
import torch.nn.functional as F

from tandem.core.ffn import DenseExecutor, MoELayerWeights
from tandem.core.ffn.dense import combine_experts, ffn_down, ffn_hidden, route, tokens_by_expert
from tandem.core.generate import prefill
from tandem.core.kv_cache import KVCache
from tandem.core.errors import TandemError

SHARED_EXPERT = -1  # ``expert`` argument of transform_hidden for a MoE layer's shared expert


@dataclass(frozen=True)
class Routing:
    """A MoE layer's top-k routing for T tokens."""
    expert_ids: torch.Tensor  # [T, k] int64, best first
    weights: torch.Tensor  # [T, k] mixing weights
    router_logits: torch.Tensor  # [T, E]


@dataclass
class LayerObservation:
    """What one FFN/MoE block saw and computed for T tokens (the dense values)."""
    layer: int
    x: torch.Tensor  # [T, d] FFN input (the normalized hidden state the block sees)
    h: torch.Tensor | None = None  # [T, F] input of the down projection (dense layers; None for MoE layers)
    routing: Routing | None = None  # MoE layers only
    expert_h: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # expert -> (token idx [n], h [n, Fe])
    shared_h: torch.Tensor | None = None  # [T, Fs] shared expert's h (Qwen2-MoE)

    def detached(self) -> "LayerObservation":
        """A copy made of ordinary tensors (usable with autograd outside inference mode)."""
        def c(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()
        routing = None if self.routing is None else Routing(*(c(t) for t in (self.routing.expert_ids, self.routing.weights, self.routing.router_logits)))
        return LayerObservation(self.layer, c(self.x), c(self.h), routing,
                                {e: (c(i), c(h)) for e, (i, h) in self.expert_h.items()}, c(self.shared_h))


class Observer(Protocol):
    def observe(self, obs: LayerObservation) -> None: ...


class ObserverGroup:
    """Fans one observation out to several observers (in order)."""

    def __init__(self, observers: Iterable[Observer | None]) -> None:
        self.observers = [o for o in observers if o is not None]

    def observe(self, obs: LayerObservation) -> None:
        for observer in self.observers:
            observer.observe(obs)


class InstrumentedExecutor(DenseExecutor):
    """A DenseExecutor that reports each layer to ``observer`` (only ``layers`` if given).

    With the default :meth:`transform_hidden` (identity) its outputs equal DenseExecutor's exactly.
    """

    def __init__(self, base: DenseExecutor, observer: Observer | None = None,
                 layers: Iterable[int] | None = None) -> None:
        super().__init__(base.cfg, base.layers)
        self.observer = observer
        self.observed_layers = None if layers is None else frozenset(int(i) for i in layers)

    def transform_hidden(self, layer: int, x: torch.Tensor, h: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        """Hook for sparsifying executors: h [T, F] -> h' [T, F] fed to the down projection.

        ``x`` [T, d] holds the FFN input rows that produced h (for predictor-gated execution);
        ``expert`` is the routed expert's index, SHARED_EXPERT, or None for a dense layer.
        """
        return h

    def _watching(self, layer: int) -> bool:
        return self.observer is not None and (self.observed_layers is None or layer in self.observed_layers)

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        weights = self.layers[layer]
        if isinstance(weights, MoELayerWeights):
            return self.moe_forward(layer, x)
        h = ffn_hidden(self.cfg, weights, x)  # [T, F]
        if self._watching(layer):
            self.observer.observe(LayerObservation(layer=layer, x=x, h=h))
        return ffn_down(weights, self.transform_hidden(layer, x, h))  # [T, d]

    def moe_forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        moe = self.layers[layer]
        expert_ids, weights, logits = route(self.cfg, moe, x)  # [T, k], [T, k], [T, E]
        routed = tokens_by_expert(expert_ids)
        expert_h: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        results: dict[int, torch.Tensor] = {}
        for expert, (token_idx, _) in routed.items():
            w = moe.experts[expert]
            x_routed = x[token_idx]  # [n, d]
            h = ffn_hidden(self.cfg, w, x_routed)  # [n, Fe]
            expert_h[expert] = (token_idx, h)
            results[expert] = ffn_down(w, self.transform_hidden(layer, x_routed, h, expert))  # [n, d]
        out = combine_experts(x, routed, results, weights)  # [T, d]
        shared_h = None
        if moe.shared_expert is not None:
            shared_h = ffn_hidden(self.cfg, moe.shared_expert, x)  # [T, Fs]
            y = ffn_down(moe.shared_expert, self.transform_hidden(layer, x, shared_h, SHARED_EXPERT))  # [T, d]
            out = out + torch.sigmoid(F.linear(x, moe.shared_expert_gate)) * y
        if self._watching(layer):
            self.observer.observe(LayerObservation(layer=layer, x=x, routing=Routing(expert_ids, weights, logits),
                                                   expert_h=expert_h, shared_h=shared_h))
        return out


def base_executor(engine) -> DenseExecutor:
    """The engine's dense executor (unwrapping instrumented ones)."""
    executor = engine.executor
    if not isinstance(executor, DenseExecutor):
        raise TandemError(f"the offline stages need the dense float32 executor (an engine loaded without plan or "
                          f"weight_format), this engine runs {type(executor).__name__}")
    return executor


def split_windows(token_ids: Sequence[int] | Sequence[Sequence[int]], window_tokens: int) -> list[list[int]]:
    """Cut a token stream (or documents, concatenated in order) into windows of at most window_tokens."""
    if window_tokens < 2:
        raise TandemError(f"window must hold at least 2 tokens, got {window_tokens}")
    flat: list[int] = []
    for item in token_ids:
        if isinstance(item, (list, tuple)):
            flat.extend(int(t) for t in item)
        else:
            flat.append(int(item))
    return [flat[i:i + window_tokens] for i in range(0, len(flat), window_tokens)]


def run_windows(engine, executor: DenseExecutor, windows: Iterable[list[int]], all_logits: bool = False,
                on_window=None) -> Iterator[torch.Tensor]:
    """Run each window as a fresh context through ``engine.model`` with ``executor``; yields logits.

    Logits are [T, vocab] with ``all_logits`` else [vocab] (last position; the cheap choice when
    only the observations matter). ``on_window(ids)`` is called before each window.
    """
    windows = list(windows)
    vocab = engine.config.vocab_size
    longest = max((len(w) for w in windows), default=0)
    if longest >= engine.max_context:
        raise TandemError(f"window of {longest} tokens exceeds the model's context of {engine.max_context}")
    cache = KVCache(engine.config, max(longest, 1))
    for ids in windows:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise TandemError(f"token id {bad[0]} is out of range for vocabulary size {vocab}")
        if on_window is not None:
            on_window(ids)
        yield prefill(engine.model, executor, cache, ids, all_logits=all_logits)


@dataclass
class CalibrationBatch:
    """One window of calibration tokens and what each observed layer saw for it."""
    token_ids: list[int]
    layers: dict[int, LayerObservation]


class _Recorder:
    def __init__(self) -> None:
        self.layers: dict[int, LayerObservation] = {}

    def observe(self, obs: LayerObservation) -> None:
        self.layers[obs.layer] = obs


def iter_calibration_batches(engine, token_ids: Sequence[int] | Sequence[Sequence[int]], window_tokens: int = 256,
                             layers: Iterable[int] | None = None) -> Iterator[CalibrationBatch]:
    """Stream observations window by window (dense model, each window a fresh context).

    ``token_ids``: a flat list of ids or a list of documents (concatenated, then cut into windows).
    ``layers``: which layers to record (default all). Yielded tensors are ordinary tensors (clones),
    safe to keep and to train on.
    """
    layer_set = _check_layers(engine, layers)
    recorder = _Recorder()
    executor = InstrumentedExecutor(base_executor(engine), recorder, layer_set)
    windows = split_windows(token_ids, window_tokens)
    if not windows:
        raise TandemError("no calibration tokens given")
    for ids, _ in zip(windows, run_windows(engine, executor, windows)):
        batch = CalibrationBatch(list(ids), {i: o.detached() for i, o in sorted(recorder.layers.items())})
        recorder.layers.clear()
        yield batch


def collect_layer_activations(engine, token_ids: Sequence[int] | Sequence[Sequence[int]],
                              layers: Iterable[int] | None = None, window_tokens: int = 256,
                              dtype: torch.dtype = torch.float32) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Run ``token_ids`` through the dense model: ``{layer: (x [N, d], h [N, F])}`` for N tokens.

    x is the FFN input (the normalized hidden state), h the input of the down projection
    (act(gate)*up or act(up)). For MoE layers h is None (per-expert h: use iter_calibration_batches).
    Memory: N * (d + F) * 4 bytes per layer in float32 (pass ``dtype=torch.float16`` to halve it).
    """
    xs: dict[int, list[torch.Tensor]] = {}
    hs: dict[int, list[torch.Tensor]] = {}
    for batch in iter_calibration_batches(engine, token_ids, window_tokens, layers):
        for i, obs in batch.layers.items():
            xs.setdefault(i, []).append(obs.x.to(dtype))
            if obs.h is not None:
                hs.setdefault(i, []).append(obs.h.to(dtype))
    return {i: (torch.cat(xs[i]), torch.cat(hs[i]) if i in hs else None) for i in sorted(xs)}


def _check_layers(engine, layers: Iterable[int] | None) -> frozenset[int] | None:
    if layers is None:
        return None
    chosen = frozenset(int(i) for i in layers)
    n = engine.config.num_layers
    bad = sorted(i for i in chosen if not 0 <= i < n)
    if bad:
        raise TandemError(f"layer {bad[0]} out of range 0..{n - 1}")
    if not chosen:
        raise TandemError("no layers selected")
    return chosen
