"""PredictorGatedExecutor: FFNs that skip neurons, by prediction and/or by the exact threshold.

Per dense FFN layer, with h = act(gate x) * up x (or act(up x)) the input of the down projection,
by the layer's mode in the PredictorSet (see ``predictors/model.py``):

- ``"predictor"``: gate and up are computed only for the rows the MLP predictor marks active for
  some token of the batch; a token's rows it does not mark are zeroed (per-token semantics);
- ``"gate"``: gate in full; up only where ``|act(gate)| * up_scale >= threshold`` (per token);
- ``"exact"`` (or no predictor set): gate and up in full.

Then, when ``exact_thresholds`` are given, entries with |h| <= threshold are dropped before the
down projection (threshold 0, as for ReLU-family models, changes nothing). With no predictors and
no thresholds this is exactly the dense computation. MoE layers run densely.
This is the correctness-first torch reference; the hybrid runtime has the fast kernels.

Example::

    ex = PredictorGatedExecutor(engine.config, engine.executor.layers, predictors=pset,
                                exact_thresholds=profile.thresholds)
    logits = prefill(engine.model, ex, KVCache(engine.config, 512), ids, all_logits=True)
    ex.stats()["gate_up_fraction"]   # share of gate/up rows computed
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.core.config import ModelConfig
from tandem.core.ffn.activations import activate, gated_hidden
from tandem.core.ffn.dense import DenseExecutor
from tandem.core.ffn.weights import FFNWeights, MoELayerWeights
from tandem.core.errors import TandemError
from .model import LayerEntry, PredictorSet


def _rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or rows is None:
        return t
    return t.index_select(0, rows)


def _union_rows(mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(row ids needed by any token or None when all are, the mask restricted to them)."""
    union = mask.any(dim=0)  # [F]
    if bool(union.all()):
        return None, mask
    rows = union.nonzero().flatten()  # [n]
    return rows, mask[:, rows]


class PredictorGatedExecutor(DenseExecutor):
    """Dense executor whose FFN layers skip predicted-inactive and below-threshold neurons.

    ``overrides``: layer -> LayerEntry used instead of the set's own entry (for trying options).
    """

    def __init__(self, cfg: ModelConfig, layers: list[FFNWeights | MoELayerWeights],
                 predictors: PredictorSet | None = None, exact_thresholds: torch.Tensor | None = None,
                 overrides: dict[int, LayerEntry] | None = None) -> None:
        super().__init__(cfg, layers)
        if predictors is not None and predictors.num_layers != cfg.num_layers:
            raise TandemError(f"predictor set has {predictors.num_layers} layers, the model {cfg.num_layers}")
        if exact_thresholds is not None and len(exact_thresholds) != cfg.num_layers:
            raise TandemError(f"{len(exact_thresholds)} exact thresholds for {cfg.num_layers} layers")
        self.predictors = predictors
        self.exact_thresholds = None if exact_thresholds is None else [float(t) for t in exact_thresholds]
        self.overrides = dict(overrides or {})
        self.reset_stats()

    def reset_stats(self) -> None:
        n = self.cfg.num_layers
        self.token_count = [0] * n
        self.gate_rows = [0] * n  # sums over tokens of rows computed for that token
        self.up_rows = [0] * n
        self.down_rows = [0] * n

    def layer_entry(self, layer: int) -> LayerEntry | None:
        if layer in self.overrides:
            return self.overrides[layer]
        return self.predictors.entry(layer) if self.predictors is not None else None

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        w = self.layers[layer]
        if isinstance(w, MoELayerWeights):
            return self.moe_forward(layer, x)
        n_tokens, n_ff = x.shape[0], w.n_neurons
        entry = self.layer_entry(layer)
        mode = entry.mode if entry is not None else "exact"
        rows = mask = None
        if mode == "predictor":
            rows, mask = _union_rows(entry.predictor(x) >= entry.threshold)  # [T, n]
        up_count = gate_count = int(mask.sum()) if mask is not None else n_tokens * n_ff
        if mode == "gate":
            if w.gate is None:
                raise TandemError(f"layer {layer}: mode 'gate' needs a gated FFN")
            a = activate(self.cfg.hidden_act, F.linear(x, w.gate, w.gate_bias), self.cfg.act_threshold)  # [T, F]
            rows, mask = _union_rows(a.abs() * entry.up_scale >= entry.threshold)  # [T, n]
            a = a if rows is None else a[:, rows]
            h = a * F.linear(x, _rows(w.up, rows), _rows(w.up_bias, rows)) * mask  # [T, n]
            up_count = int(mask.sum())
        else:
            up = F.linear(x, _rows(w.up, rows), _rows(w.up_bias, rows))  # [T, n]
            if w.gate is None:
                h = activate(self.cfg.hidden_act, up, self.cfg.act_threshold)  # [T, n]
            else:
                gate = F.linear(x, _rows(w.gate, rows), _rows(w.gate_bias, rows))  # [T, n]
                h = gated_hidden(self.cfg.hidden_act, gate, up, self.cfg.act_threshold)  # [T, n]
            if mask is not None:
                h = h * mask
        threshold = self.exact_thresholds[layer] if self.exact_thresholds is not None else 0.0
        if threshold > 0.0:
            h = h * (h.abs() > threshold)
        self.token_count[layer] += n_tokens
        self.gate_rows[layer] += gate_count if w.gate is not None else 0
        self.up_rows[layer] += up_count
        self.down_rows[layer] += int((h != 0).sum())
        down = w.down if rows is None else w.down.index_select(1, rows)  # [d, n]
        return F.linear(h, down, w.down_bias)  # [T, d]

    def stats(self) -> dict:
        """Achieved shares of rows computed, per layer and averaged over the dense layers.

        ``gate_up_fraction``: of the gate and up rows together (up only for plain FFNs).
        """
        per_layer = []
        for i, w in enumerate(self.layers):
            if isinstance(w, MoELayerWeights) or self.token_count[i] == 0:
                per_layer.append(None)
                continue
            total = self.token_count[i] * w.n_neurons
            first = (self.gate_rows[i] + self.up_rows[i]) / (2 * total if w.gate is not None else total)
            per_layer.append({"gate_up_fraction": first, "up_fraction": self.up_rows[i] / total,
                              "down_fraction": self.down_rows[i] / total})
        done = [p for p in per_layer if p is not None]

        def mean(key: str) -> float:
            return sum(p[key] for p in done) / len(done) if done else 1.0
        return {"layers": per_layer, "gate_up_fraction": mean("gate_up_fraction"),
                "up_fraction": mean("up_fraction"), "down_fraction": mean("down_fraction")}
