"""The fused decode step's measured cost terms, and the modeled time per token they give.

The cost model (cost_model.py) charges bytes / bandwidth with the probe's raw read bandwidth and no
fixed costs; it overrated the cpu-only SmolLM2 plan by 1.5-2.5x. ``tandem probe --fused FILE``
(online.plan_measure, online.kind_probe) measures

    seconds per token = call_s + n_layers * layer_s + passes * pass_s
                        + sum over (format, access) of bytes / (share(format, access, row fraction) * read_bandwidth)
                                                       + row_s(format, access) * (rows - bytes / probe's row bytes)

(call_s: one OpenMP region, embedding, output setup, the token loop; layer_s: the barriers and small
vectors of a layer, both fitted on tiny random Llama models; pass_s: what each matrix read costs beyond its
bytes (every pass restarts the threads' streams and ends at a barrier; online.kind_probe.measure_pass_cost),
times the step's passes per token (step_reads.modeled_passes); share: the row kernels' rate on that packed
format and access pattern (dense / gather / axpy, at 10 / 40 / 100% of the rows) over the probe's read
bandwidth; row_s: what each row costs beyond its bytes, from passes over rows of two widths, so that the
narrow rows of a small model's matrices and of predictors, and the wide rows of a 7B's, are priced at their
length). The bytes are the step's own packed tensors at the plan's row shares (placement.step_reads).
The reads a step repeats every token (whole matrices, the KV cache: RESIDENT_ACCESSES) are divided by the
cache's speedup at the step's bytes per token (``residency``: online.residency_probe; on the Intel VM ~2x up
to 16 MB, 1.3-1.4x at 64 MB, 1.0-1.15x at SmolLM2's ~100 MB, 1.0 from 128 MB); gathered and added rows change
between tokens and are priced from memory.
``step_seconds`` keeps the earlier form: nominal bytes at one share per weight format.

Example::

    cal = measure_fused_calibration(threads=2)              # ~40 s (online.plan_measure: it times engines)
    cal.reads_seconds(n_layers, reads, fractions=shares, passes=passes, rows=rows)  # placement.step_reads' terms
    cal.residency_at(97e6)                                    # the cache's speedup for a 97 MB step
    cal.step_seconds("int4", n_layers=16, read_bytes=600e6)
    calibrated_plan_tokens_per_s(plan, cal)                   # cpu-only plans, nominal bytes
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tandem.core.artifacts import atomic_write_json
from tandem.core.errors import TandemError

from .step_reads import ACCESSES, WHOLE_ACCESSES

FORMATS = ("int4", "int8")
FALLBACK = {"pair": ("gather",), "rows": ("dense",), "dense_gu": ("dense",), "rows_gu": ("rows", "dense")}
# (layers, hidden, ffn) of the three timed models: fixed costs from the two small ones, bandwidth from the big one
SIZES = ((2, 256, 1024), (10, 256, 1024), (2, 1536, 6144))
# tiny layers (hidden 64, FFN 128: ~25 KB of weights each) whose time is the step's fixed costs
FIXED_SIZES = ((2, 64, 128), (18, 64, 128))
RESIDENT_ACCESSES = WHOLE_ACCESSES + ("attend",)  # read again every token: the cache keeps what fits


@dataclass(frozen=True)
class FusedTerms:
    weight_format: str
    call_s: float
    layer_s: float
    bandwidth_share: float
    samples: tuple = ()  # (layers, read_bytes, measured seconds) per timed model

    def __post_init__(self) -> None:
        if not (self.bandwidth_share > 0 and self.call_s >= 0 and self.layer_s >= 0):
            raise TandemError(f"invalid fused-step terms for {self.weight_format}: {self}")


@dataclass(frozen=True)
class KindRate:
    """The share of the read bandwidth the step's row kernels reach on one packed format and access
    pattern (placement.step_reads: dense / gather / axpy / ...), from one timed pass (online.kind_probe);
    ``attend``: the attention kernel over a KV cache of that element type (kind f16 / f32).

    ``row_s``: what each row read costs beyond its bytes, in seconds (the threads together), where the
    probe's rows are ``row_bytes`` long: a pass over rows of b bytes takes bytes / (share x bandwidth) +
    row_s x (rows - bytes / row_bytes), so narrower rows than the probe's run slower and wider ones faster
    (kind_probe times two widths; 0: files from before it, one rate whatever the width)."""
    kind: str
    access: str
    share: float
    bytes: int = 0
    seconds: float = 0.0
    fraction: float = 1.0  # share of the matrix's rows the timed pass read (gather / axpy); attend: KV heads / query heads
    row_s: float = 0.0
    row_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.access not in ACCESSES:
            raise TandemError(f"invalid fused-step rate for {self.kind}: access {self.access!r} is not one of {ACCESSES}")
        if not (isinstance(self.share, (int, float)) and 0 < self.share < 100):
            raise TandemError(f"invalid fused-step rate for {self.kind} {self.access}: share {self.share!r}")
        if not (isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1):
            raise TandemError(f"invalid fused-step rate for {self.kind} {self.access}: row fraction {self.fraction!r}")
        if not all(isinstance(v, (int, float)) and 0 <= v < 1e9 for v in (self.row_s, self.row_bytes)) or \
                self.row_s >= 1e-3 or (self.row_s > 0 and not self.row_bytes > 0):
            raise TandemError(f"invalid fused-step rate for {self.kind} {self.access}: row cost {self.row_s!r} s "
                              f"at {self.row_bytes!r} bytes a row")

    def pass_seconds(self, nbytes: float, bandwidth: float, rows: float | None = None) -> float:
        """Seconds to read ``nbytes`` in ``rows`` rows at ``bandwidth`` (rows None: at the probe's row length)."""
        seconds = nbytes / (self.share * bandwidth)
        if rows and self.row_s > 0:
            seconds += self.row_s * (rows - nbytes / self.row_bytes)
        return max(seconds, 0.0)


@dataclass(frozen=True)
class FusedCalibration:
    threads: int
    read_bandwidth_bytes_per_s: float
    terms: tuple[FusedTerms, ...]
    description: str = ""
    rates: tuple[KindRate, ...] = ()  # per packed format and access (empty in files written before them)
    pass_s: float = 0.0  # seconds per matrix pass beyond its bytes (0 in files written before it)
    residency: tuple = ()  # ((working set bytes, speedup), ...) ascending (empty in files written before it: 1.0)

    def __post_init__(self) -> None:
        if not (isinstance(self.pass_s, (int, float)) and 0.0 <= self.pass_s < 1.0):
            raise TandemError(f"invalid fused-step calibration: pass cost {self.pass_s!r} s")
        pairs = isinstance(self.residency, (tuple, list)) and all(
            isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(x, (int, float)) for x in p)
            for p in self.residency)
        if not pairs or not all(0 < b < 2**62 and 0.2 < v < 50 for b, v in self.residency) or \
                [b for b, _ in self.residency] != sorted({b for b, _ in self.residency}):
            raise TandemError(f"invalid fused-step calibration: residency {self.residency!r} "
                              "(want ascending (working set bytes, speedup) pairs)")
        object.__setattr__(self, "residency", tuple((b, v) for b, v in self.residency))  # hashable, round-trips

    def residency_at(self, working_set_bytes: float) -> float:
        """The cache's speedup on reads repeated every token over ``working_set_bytes``: the measured pairs
        made non-increasing in size (monotone_speedups: a larger working set cannot find more of itself in the
        cache; a noisy pair must not raise a larger one), interpolated linearly in log bytes, the end values
        beyond them, never below 1 (1.0 without pairs)."""
        pts = tuple(zip((b for b, _ in self.residency), monotone_speedups([v for _, v in self.residency])))
        if not pts or not working_set_bytes > 0:
            return 1.0
        if working_set_bytes <= pts[0][0]:
            return max(1.0, pts[0][1])
        if working_set_bytes >= pts[-1][0]:
            return max(1.0, pts[-1][1])
        (b0, v0), (b1, v1) = next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= working_set_bytes <= b[0])
        w = (math.log(working_set_bytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
        return max(1.0, float(v0 + w * (v1 - v0)))

    def access_speedup(self, access: str, working_set_bytes: float) -> float:
        """The cache's speedup on reads of ``access`` in a step of ``working_set_bytes`` per token:
        residency_at for the accesses repeated every token (RESIDENT_ACCESSES), 1.0 for the others."""
        return self.residency_at(working_set_bytes) if access in RESIDENT_ACCESSES else 1.0

    def term(self, weight_format: str) -> FusedTerms:
        for t in self.terms:
            if t.weight_format == weight_format:
                return t
        raise TandemError(f"no fused-step calibration for weight format {weight_format!r} "
                          f"(have {', '.join(t.weight_format for t in self.terms)})")

    def step_seconds(self, weight_format: str, n_layers: int, read_bytes: float) -> float:
        t = self.term(weight_format)
        return t.call_s + n_layers * t.layer_s + read_bytes / (t.bandwidth_share * self.read_bandwidth_bytes_per_s)

    def rate(self, kind: str, access: str, fraction: float | None = None) -> KindRate:
        """The measured rate of (kind, access), at ``fraction`` of the rows (for ``attend``: KV heads per query
        head) linearly between the fractions timed (clamped at the ends; None: the densest). An access not
        timed falls back to its nearest timed one (FALLBACK: paired rows as gathered ones, gate and up read
        together as one matrix read whole, in-place rows as dense ones); a KV type whose attention was not
        timed takes the other type's, and a calibration from before the attention pass prices the KV cache at
        its float32 dense rate, as it did then."""
        for want in (access,) + FALLBACK.get(access, ()) + ("dense",):
            found = sorted((r for r in self.rates if r.kind == kind and r.access == want), key=lambda r: r.fraction)
            if not found:
                if access == "attend" and want == "attend":  # the other element type's attention, else f32 dense
                    other = [r.kind for r in self.rates if r.access == "attend"]
                    return self.rate(other[0], "attend", fraction) if other else self.rate("f32", "dense")
                continue
            if fraction is None or fraction >= found[-1].fraction:
                return found[-1]
            if fraction <= found[0].fraction:
                return found[0]
            lo, hi = next((a, b) for a, b in zip(found, found[1:]) if a.fraction <= fraction <= b.fraction)
            if hi.fraction == lo.fraction:
                return lo
            w = (fraction - lo.fraction) / (hi.fraction - lo.fraction)
            row_bytes = lo.row_bytes or hi.row_bytes  # the probe's row length (0 where a pass found no row cost)
            row_s = lo.row_s + w * (hi.row_s - lo.row_s) if row_bytes else 0.0
            return KindRate(kind, want, lo.share + w * (hi.share - lo.share), fraction=fraction, row_s=row_s,
                            row_bytes=row_bytes)
        raise TandemError(f"no fused-step rate for {kind} ({access}) in this calibration "
                          f"(have {', '.join(sorted({r.kind for r in self.rates})) or 'none'}; rerun `tandem probe --fused`)")

    def reads_seconds(self, n_layers: int, reads: dict, fixed: bool = True, fractions: dict | None = None,
                      passes: int = 0, working_set_bytes: float | None = None, rows: dict | None = None) -> float:
        """Modeled seconds per token: the fixed costs (the int4 term's call_s and layer_s, and ``passes``
        matrix passes at pass_s; ``fixed`` False: none) plus each (format, access)'s bytes at its measured
        share of the read bandwidth (placement.step_reads), at the row fraction ``fractions`` gives it
        (step_reads.read_fractions), in the rows ``rows`` gives it (step_reads.modeled_rows: the per-row
        cost, KindRate.pass_seconds; None: at the probe's row length); the resident accesses' whole passes (row
        costs included: a row read from the cache starts sooner too) at the cache's speedup (residency_at) over
        ``working_set_bytes`` (None: the step's bytes per token, the sum of ``reads``)."""
        seconds = 0.0
        if fixed:
            term = self.term("int4")
            seconds = term.call_s + n_layers * term.layer_s + passes * self.pass_s
        working_set = sum(reads.values()) if working_set_bytes is None else working_set_bytes
        for (kind, access), nbytes in reads.items():
            rate = self.rate(kind, access, (fractions or {}).get((kind, access)))
            pass_s = rate.pass_seconds(nbytes, self.read_bandwidth_bytes_per_s, (rows or {}).get((kind, access)))
            seconds += pass_s / self.access_speedup(access, working_set)
        return seconds

    def to_dict(self) -> dict:
        return {"kind": "tandem-fused-calibration", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "FusedCalibration":
        try:
            terms = tuple(FusedTerms(**{**t, "samples": tuple(tuple(s) for s in t.get("samples", ()))}) for t in d["terms"])
            rates = tuple(KindRate(**r) for r in d.get("rates", ()))
            return cls(threads=int(d["threads"]), read_bandwidth_bytes_per_s=float(d["read_bandwidth_bytes_per_s"]),
                       terms=terms, description=str(d.get("description", "")), rates=rates,
                       pass_s=float(d.get("pass_s", 0.0)),
                       residency=tuple((int(b), float(v)) for b, v in d.get("residency", ())))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise TandemError(f"invalid fused-step calibration: {e}") from None


def monotone_speedups(values: list[float]) -> list[float]:
    """The non-increasing sequence closest to ``values`` in least squares (pool adjacent violators: each run of
    values that rises is replaced by its mean until none does).

    Example::

        monotone_speedups([2.2, 0.9, 1.5, 1.8, 1.0, 1.1])   # [2.2, 1.4, 1.4, 1.4, 1.05, 1.05]
    """
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def save_calibration(cal: FusedCalibration, path: str | Path) -> Path:
    atomic_write_json(path, cal.to_dict())
    return Path(path)


def load_calibration(path: str | Path) -> FusedCalibration:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise TandemError(f"cannot read fused-step calibration {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or data.get("kind") != "tandem-fused-calibration":
        raise TandemError(f"{path} is not a fused-step calibration (write one with `tandem probe --fused FILE`)")
    return FusedCalibration.from_dict(data)


def fit_terms(fmt: str, samples: list, bandwidth: float) -> FusedTerms:
    a = np.array([[1.0, layers, read] for layers, read, _ in samples])  # unknowns: call_s, layer_s, s per byte
    y = np.array([s for _, _, s in samples])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    call_s, layer_s, per_byte = (float(c) for c in coef)
    if per_byte <= 0:  # noise swamped the big model: fall back to its plain rate
        layers, read, seconds = max(samples, key=lambda s: s[1])
        per_byte = seconds / read
    share = min(1.5, 1.0 / (per_byte * bandwidth))
    return FusedTerms(fmt, max(call_s, 0.0), max(layer_s, 0.0), share, tuple(samples))


def fit_fixed_terms(fmt: str, samples: list, byte_seconds: list, share: float) -> FusedTerms:
    """call_s and layer_s by least squares on what the reads do not explain: ``samples`` (layers,
    read_bytes, measured seconds) of tiny models (FIXED_SIZES), ``byte_seconds`` their reads at the
    measured per-format rates and their passes at the pass cost; ``share``: the format's dense share
    (kept for the nominal model)."""
    a = np.array([[1.0, layers] for layers, _, _ in samples])
    y = np.array([s - b for (_, _, s), b in zip(samples, byte_seconds)])
    (call_s, layer_s), *_ = np.linalg.lstsq(a, y, rcond=None)
    return FusedTerms(fmt, max(float(call_s), 0.0), max(float(layer_s), 0.0), share, tuple(samples))


def best_of(cals: list[FusedCalibration]) -> FusedCalibration:
    """One calibration from several taken under contention (which only ever slows a measurement): each
    (format, access) at its fastest round, the read bandwidth at its highest, the fixed costs (pass cost
    included) at their smallest; the cache's speedup (a ratio of two reads, not a rate) at its median per
    working set."""
    if not cals:
        raise TandemError("best_of needs at least one calibration")
    bandwidth = max(c.read_bandwidth_bytes_per_s for c in cals)
    fastest: dict = {}
    for c in cals:
        for r in c.rates:
            rate = r.share * c.read_bandwidth_bytes_per_s
            if rate > fastest.get((r.kind, r.access, r.fraction), (0.0, None))[0]:
                fastest[(r.kind, r.access, r.fraction)] = (rate, r)
    rates = tuple(KindRate(k, a, rate / bandwidth, r.bytes, r.seconds, f, r.row_s, r.row_bytes)
                  for (k, a, f), (rate, r) in fastest.items())
    terms = []
    for t in cals[0].terms:
        same = [c.term(t.weight_format) for c in cals]
        terms.append(FusedTerms(t.weight_format, min(x.call_s for x in same), min(x.layer_s for x in same),
                                max(x.bandwidth_share for x in same)))
    by_size: dict = {}
    for c in cals:
        for size, speedup in c.residency:
            by_size.setdefault(size, []).append(speedup)
    residency = tuple((size, float(np.median(v))) for size, v in sorted(by_size.items()))
    return FusedCalibration(cals[0].threads, bandwidth, tuple(terms), f"best of {len(cals)} calibrations", rates,
                            pass_s=min(c.pass_s for c in cals), residency=residency)


def calibrated_plan_tokens_per_s(plan, cal: FusedCalibration, weight_format: str = "int4") -> float | None:
    """Modeled tok/s of a cpu-only plan with the measured terms (None for plans using a GPU): the
    plan's modeled bytes (its time x the hardware's read bandwidth) at the fused step's rates."""
    if plan.gpu_bytes > 0:
        return None
    read_bytes = plan.modeled["time_per_token_s"] * plan.hardware.cpu_bandwidth_bytes_per_s
    return 1.0 / cal.step_seconds(weight_format, plan.num_layers, read_bytes)
