"""What the fused decode step reads per token, by packed format and access pattern (the cost model's bytes).

The step reads each weight in the format the runtime packed it in: GGUF blocks in place (q4_0 / q4_1 with
f16 scales, q8_0, q4_k, q5_0, q5_k, q6_k), dense down projections in their blocks, sparse down rows (f16,
int8), re-packed int4 / int8 and float32. A ``StepUnit`` is one such packed tensor with its real bytes
(online.step_inventory lists them for a built step); ``layer_fractions`` gives the share of its rows a
token reads (from the profile's neuron frequencies and the predictors' recall, as problem.py models
them); ``modeled_reads`` sums bytes per token by (format, access):

- ``dense``: the whole matrix streamed row after row (attention, output layer, gate/up of non-ReLU exact
  layers, dense downs, predictors) in the step's eight-row interleaved copies (or a format it does not
  interleave);
- ``rows``: the same, GGUF blocks read row by row in place where the step keeps a matrix as it is for
  gathered reads (the gate/up of predictor and ReLU layers, read whole by the gate cut or a dense mode):
  ~15% slower than the interleaved copy here (bench/RESULTS.md, fourteenth session);
- ``gather``: selected rows dotted (ReLU layers' up rows, predicted gate/up rows);
- ``pair``: a predictor layer's paired copy of gate and up (gate row r at 2r, up row r at 2r + 1), where
  the step keeps one: each predicted neuron's two rows in one contiguous read, both always read
  (~10-20% faster than two single gathered rows here);
- ``axpy``: selected down rows added into the output (sparse down_t);
- ``dense_gu`` / ``rows_gu``: a gated layer's gate and up both read whole (interleaved copies / in place),
  as the step's dense slice loop reads them: 32 rows of up, then the same 32 of gate, one pass for both
  (two streams per thread: 5-18% slower than one matrix here, bench/RESULTS.md, sixteenth session).

Beside the weights, attention reads the KV cache: ``kv_reads`` adds the keys and values (float16 by default,
the engine's kv_cache_type) of every layer's KV heads over the tokens before the step (a layer's window caps
them) as ``(type, "attend")`` bytes; the attention kernel's rate depends on the query heads per KV head,
which ``kv_shares`` gives as the access's row fraction (1 / group size). At a 64-token prompt on a 16-head,
24-layer model that is 8.7 MB per token (float16) beside 130 MB of weights: leaving it out overrated the
modeled tok/s and the bytes limit.

Example::

    fractions = layer_fractions("relu", stats.neuron_freq, predictor_info)
    reads = modeled_reads(units, fractions, relu=True)    # {("q4_0", "dense"): 3.1e8, ("f16", "axpy"): ...}
    shares = read_fractions(units, fractions, relu=True)  # {("f16", "axpy"): 0.1, ...}: rows read, byte-weighted
    passes = modeled_passes(units, fractions, relu=True)  # matrix passes per token
    rows = modeled_rows(units, fractions, relu=True)      # rows read per token (each row's own cost)
    reads = with_kv(reads, kv_reads(cfg, context_tokens=88))  # the KV cache at the tokens' mean position
    shares = with_kv(shares, kv_shares(cfg))                   # its rate's key: query heads per KV head
    cal.reads_seconds(n_layers, reads, fractions=shares, passes=passes, rows=rows)  # placement.fused_calibration

(``step_read_terms`` gives those reads, shares, passes and rows, the KV cache's included, in one call.)
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from tandem.core.errors import TandemError
from tandem.core.config import kv_row_bytes

ACCESSES = ("dense", "rows", "gather", "pair", "axpy", "dense_gu", "rows_gu", "attend")
WHOLE_ACCESSES = ("dense", "rows", "dense_gu", "rows_gu")  # every row of the matrix read: no row fraction
IN_PLACE = {"dense": "rows", "dense_gu": "rows_gu"}  # the same reads of GGUF blocks kept row by row
ROLES = ("qkv", "k", "v", "o", "gate", "up", "down", "down_t", "pred", "head", "embed_row")


@dataclass(frozen=True)
class StepUnit:
    """One packed tensor the step reads: ``packed_bytes`` of its data, scales and minimums."""
    role: str  # one of ROLES (qkv: the stacked q/k/v, or q alone where k / v are kept apart)
    layer: int  # -1 for the output layer and the embedding row
    kind: str  # packed format name (online.step_inventory.KIND_NAMES)
    packed_bytes: int
    in_place: bool = False  # GGUF blocks the step could interleave eight rows at a time but keeps row by row
    paired: bool = False  # a gate / up whose predicted rows the step reads from its paired copy (predict.h)
    rows: int = 0  # the matrix's rows (0: not known; modeled_rows leaves such a unit's format and access out)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise TandemError(f"unknown step unit role {self.role!r}")
        if self.packed_bytes < 0 or self.rows < 0:
            raise TandemError(f"step unit {self.role} of layer {self.layer} has negative bytes or rows")


@dataclass(frozen=True)
class LayerFractions:
    """Share of each FFN matrix's rows one token reads, and whether the layer runs a predictor."""
    gate: float
    up: float
    down: float
    predicted: bool = False


def layer_fractions(activity: str, neuron_freq: np.ndarray, predictors=None) -> list[LayerFractions]:
    """Per layer: the exact path reads gate (and, non-ReLU, up) in full and the active down rows; ReLU
    layers skip the up rows their gate zeroes; predictor layers read the predicted gate rows and, of those,
    the truly active up/down rows (``recall`` x frequency). ``neuron_freq``: [L, F] active fractions."""
    out = []
    relu = activity == "relu"
    for i, freq in enumerate(np.asarray(neuron_freq, dtype=np.float64)):
        active = float(freq.mean()) if freq.size else 0.0
        info = predictors.layers[i] if predictors is not None else None
        if info is not None and info.used:
            fpr = 0.0
            if active < 1.0:
                fpr = min(max((info.predicted_active_fraction - info.recall * active) / (1.0 - active), 0.0), 1.0)
            predicted = float(np.clip(info.recall * freq + fpr * (1.0 - freq), 0.0, 1.0).mean())
            found = info.recall * active
            out.append(LayerFractions(gate=predicted, up=found if relu else predicted, down=found, predicted=True))
        else:
            out.append(LayerFractions(gate=1.0, up=active if relu else 1.0, down=active))
    return out


def unit_access(unit: StepUnit, fractions: LayerFractions | None, relu: bool, gated: bool = False) -> tuple[str, float]:
    """(access pattern, share of the unit's bytes read per token); ``relu``: the layer's gate cut skips up rows;
    ``gated``: the layer has a gate (its gate and up, both read whole, are one slice loop)."""
    if unit.role in ("gate", "up", "down_t") and fractions is None:
        raise TandemError(f"no row fractions for layer {unit.layer}'s {unit.role}")
    if unit.role in ("gate", "up") and unit.paired and fractions.predicted:
        return "pair", fractions.gate  # every predicted neuron's gate and up rows, read together
    whole = "dense_gu" if gated and not (fractions.predicted or relu) else "dense"
    if unit.role == "gate":
        return ("gather", fractions.gate) if fractions.predicted else (whole, 1.0)
    if unit.role == "up":
        return ("gather", fractions.up) if (fractions.predicted or relu) else (whole, 1.0)
    if unit.role == "down_t":
        return "axpy", fractions.down
    if unit.role == "pred":  # read only where the layer runs its predictor
        return "dense", 1.0 if fractions is not None and fractions.predicted else 0.0
    return "dense", 1.0


def modeled_reads(units: list[StepUnit], fractions: list[LayerFractions] | None, relu: bool) -> dict[tuple[str, str], float]:
    """Bytes per token by (format, access). ``fractions`` None: every row of every unit, no predictors."""
    reads: dict[tuple[str, str], float] = defaultdict(float)
    for _, key, nbytes, _ in _unit_reads(units, fractions, relu):
        reads[key] += nbytes
    return dict(reads)


def modeled_rows(units: list[StepUnit], fractions: list[LayerFractions] | None,
                 relu: bool) -> dict[tuple[str, str], float]:
    """Rows read per token by (format, access), each unit's rows at its row share (FusedCalibration prices
    each row's own cost with them: KindRate.row_s). A (format, access) with any unit of unknown rows is left
    out (priced at the probe's row length)."""
    rows: dict[tuple[str, str], float] = defaultdict(float)
    unknown = set()
    for u, key, _, share in _unit_reads(units, fractions, relu):
        if u.rows > 0:
            rows[key] += share * u.rows
        else:
            unknown.add(key)
    return {key: n for key, n in rows.items() if key not in unknown}


def read_fractions(units: list[StepUnit], fractions: list[LayerFractions] | None, relu: bool) -> dict[tuple[str, str], float]:
    """The byte-weighted mean share of rows read per (format, access) (the row kernels' rate depends on it)."""
    weighted: dict[tuple[str, str], float] = defaultdict(float)
    for _, key, nbytes, share in _unit_reads(units, fractions, relu):
        weighted[key] += share * nbytes
    reads = modeled_reads(units, fractions, relu)
    return {key: min(1.0, weighted[key] / b) for key, b in reads.items() if b > 0}


def _unit_reads(units, fractions, relu):
    """(unit, (format, access), bytes read, the unit's row share) per unit read at all. Only a gated layer's
    gate cut skips up rows: an ungated ReLU FFN (OPT) reads every up row and keeps its zeros for the down."""
    gated = {u.layer for u in units if u.role == "gate"}
    for u in units:
        if fractions is None:
            access, share = ("axpy" if u.role == "down_t" else "dense"), (0.0 if u.role == "pred" else 1.0)
            if u.role in ("gate", "up") and u.layer in gated:
                access = "dense_gu"
        else:
            f = fractions[u.layer] if 0 <= u.layer < len(fractions) else None
            access, share = unit_access(u, f, relu and u.layer in gated, u.layer in gated)
        if access in IN_PLACE and u.in_place:
            access = IN_PLACE[access]
        if share > 0:
            yield u, (u.kind, access), share * u.packed_bytes, share


def modeled_passes(units: list[StepUnit], fractions: list[LayerFractions] | None, relu: bool) -> int:
    """Matrix passes per token: the units read at all (each is one pass of the step's row kernels over its
    rows, ending at a barrier; a paired gate and up, or a gate and up read whole together, are one pass);
    the embedding row is a copy, not a pass."""
    reads = _unit_reads([u for u in units if u.role != "embed_row"], fractions, relu)
    return sum(1 for u, (_, access), _, _ in reads if not (access in ("pair", "dense_gu", "rows_gu") and u.role == "up"))


def bytes_by_kind(units: list[StepUnit]) -> dict[str, int]:
    """Packed bytes per format over all units (each counted once)."""
    out: dict[str, int] = defaultdict(int)
    for u in units:
        out[u.kind] += u.packed_bytes
    return dict(out)


def format_reads(reads: dict[tuple[str, str], float]) -> str:
    """One line: 'q4_0 dense 412.3 MB, f16 axpy 20.1 MB, ...' (largest first)."""
    return ", ".join(f"{k} {a} {b / 1e6:.1f} MB" for (k, a), b in sorted(reads.items(), key=lambda kv: -kv[1]))


KV_TYPES = {"f16": 2, "f32": 4}  # the KV cache's element types (EngineArgs.kv_cache_type): bytes per element


def kv_kind(kv_cache_type: str = "f16") -> tuple[str, str]:
    """The (format, access) of the KV cache's reads: the attention kernel over keys and values of that type."""
    if kv_cache_type not in KV_TYPES:
        raise TandemError(f"unknown KV cache type {kv_cache_type!r} (known: {', '.join(KV_TYPES)})")
    return kv_cache_type, "attend"


def kv_read_bytes(cfg, context_tokens: float, kv_cache_type: str = "f16") -> float:
    """Bytes of the KV cache one decode step reads at ``context_tokens`` tokens before it: keys and values
    (of ``kv_cache_type``) of each layer's KV heads, over the layer's window where it has one."""
    if context_tokens < 0:
        raise TandemError(f"context must be >= 0 tokens, got {context_tokens}")
    kv_kind(kv_cache_type)
    windows = cfg.layer_windows or (cfg.sliding_window or 0,) * cfg.num_layers
    row = kv_row_bytes(cfg, KV_TYPES[kv_cache_type])
    return float(sum(row * (min(context_tokens, w) if w else context_tokens) for w in windows))


def kv_reads(cfg, context_tokens: float, kv_cache_type: str = "f16") -> dict[tuple[str, str], float]:
    """{kv_kind: kv_read_bytes}: merge into modeled_reads' dict with ``with_kv``."""
    return {kv_kind(kv_cache_type): kv_read_bytes(cfg, context_tokens, kv_cache_type)}


def kv_shares(cfg, kv_cache_type: str = "f16") -> dict[tuple[str, str], float]:
    """{kv_kind: KV heads / query heads}: the attention rate's key (read_fractions' dict for ``with_kv``),
    since a KV row serves every query head of its group (more arithmetic per byte, a slower byte rate)."""
    return {kv_kind(kv_cache_type): cfg.num_kv_heads / cfg.num_heads}


def with_kv(reads: dict, kv: dict) -> dict:
    """The weight reads with the KV cache's added (same keys summed; for kv_shares' dict, the same keys
    never occur in the weights')."""
    out = dict(reads)
    for key, nbytes in kv.items():
        out[key] = out.get(key, 0.0) + nbytes
    return out


def step_read_terms(units: list[StepUnit], fractions: list[LayerFractions] | None, relu: bool, cfg,
                    context_tokens: float, kv_cache_type: str = "f16") -> tuple[dict, dict, int, dict]:
    """(bytes per token, row shares, matrix passes per token, rows per token) of a step's weights and its KV
    cache at ``context_tokens``: FusedCalibration.reads_seconds' reads, fractions, passes and rows in one call
    (the KV cache's attention has no rows)."""
    reads = with_kv(modeled_reads(units, fractions, relu), kv_reads(cfg, context_tokens, kv_cache_type))
    shares = with_kv(read_fractions(units, fractions, relu), kv_shares(cfg, kv_cache_type))
    return reads, shares, modeled_passes(units, fractions, relu), modeled_rows(units, fractions, relu)
