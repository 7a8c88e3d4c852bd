"""The fused decode step's measured cost terms, and the modeled time per token they give.

The cost model (cost_model.py) charges bytes / bandwidth with the probe's raw read bandwidth and no
fixed costs; it overrated the cpu-only SmolLM2 plan by 1.5-2.5x. ``tandem probe --fused FILE``
times the real fused C step on random Llama models of three sizes per weight format and fits

    seconds per token = call_s + n_layers * layer_s + read_bytes / (bandwidth_share * read_bandwidth)

(call_s: one OpenMP region, embedding, output setup; layer_s: the barriers and small vectors of a
layer; bandwidth_share: the share of the probe's read bandwidth the row kernels reach).

Example::

    cal = measure_fused_calibration(threads=2)              # ~20 s (online.plan_measure: it times engines)
    cal.step_seconds("int4", n_layers=16, read_bytes=600e6)
    calibrated_plan_tokens_per_s(plan, cal)                   # cpu-only plans
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tandem.core.artifacts import atomic_write_json
from tandem.core.errors import TandemError

FORMATS = ("int4", "int8")
# (layers, hidden, ffn) of the three timed models: fixed costs from the two small ones, bandwidth from the big one
SIZES = ((2, 256, 1024), (10, 256, 1024), (2, 1536, 6144))


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
class FusedCalibration:
    threads: int
    read_bandwidth_bytes_per_s: float
    terms: tuple[FusedTerms, ...]
    description: str = ""

    def term(self, weight_format: str) -> FusedTerms:
        for t in self.terms:
            if t.weight_format == weight_format:
                return t
        raise TandemError(f"no fused-step calibration for weight format {weight_format!r} "
                          f"(have {', '.join(t.weight_format for t in self.terms)})")

    def step_seconds(self, weight_format: str, n_layers: int, read_bytes: float) -> float:
        t = self.term(weight_format)
        return t.call_s + n_layers * t.layer_s + read_bytes / (t.bandwidth_share * self.read_bandwidth_bytes_per_s)

    def to_dict(self) -> dict:
        return {"kind": "tandem-fused-calibration", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "FusedCalibration":
        try:
            terms = tuple(FusedTerms(**{**t, "samples": tuple(tuple(s) for s in t.get("samples", ()))}) for t in d["terms"])
            return cls(threads=int(d["threads"]), read_bandwidth_bytes_per_s=float(d["read_bandwidth_bytes_per_s"]),
                       terms=terms, description=str(d.get("description", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise TandemError(f"invalid fused-step calibration: {e}") from None


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


def calibrated_plan_tokens_per_s(plan, cal: FusedCalibration, weight_format: str = "int4") -> float | None:
    """Modeled tok/s of a cpu-only plan with the measured terms (None for plans using a GPU): the
    plan's modeled bytes (its time x the hardware's read bandwidth) at the fused step's rates."""
    if plan.gpu_bytes > 0:
        return None
    read_bytes = plan.modeled["time_per_token_s"] * plan.hardware.cpu_bandwidth_bytes_per_s
    return 1.0 / cal.step_seconds(weight_format, plan.num_layers, read_bytes)
