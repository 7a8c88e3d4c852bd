"""``synthesize``: stream a synthetic-weights GGUF of a named shape, layer by layer, and measure it.

The file is written tensor by tensor (a 7B shape never sits in memory as a whole): tensor infos
first, then each layer's weights as soon as the float forward of the sample tokens has reached it
(the biases of each layer's gates are calibrated on the FFN inputs the earlier layers produce).
Half of the sample sequences calibrate, the other half measure the realised statistics, which go
into the GGUF header (``tandem.synth.stats``, patched in place) and into ``<file>.synth.json``.

Example::

    result = synthesize(SynthSpec(get_shape("tiny")), "out/", tokenizer_gguf="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    result.stats["summary"]["sparsity"]        # ~0.90 (synthetic weights)
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tandem.core.errors import TandemError

from .activity import firing_rates, hot_share_of
from .gguf_out import StreamingGGUF, tensor_plan
from .layers import BIAS_DIMS, attention, ffn_apply, gaussian, rms_norm, rope_tables, roundtrip, sparse_ffn
from .shapes import Shape

SPARSITY_TOLERANCE = 0.02   # |realised - requested| mean sparsity
HOT_SHARE_TOLERANCE = 0.06  # |realised - requested| hot share (rates estimated from held-out tokens)
QTYPES = ("Q4_0", "Q4_1")


@dataclass(frozen=True)
class SynthSpec:
    shape: Shape
    sparsity: float = 0.9
    hot_fraction: float = 0.26
    hot_share: float = 0.8
    gate_rank: int = 48          # rank of the predictable part of the gate
    gate_noise: float = 0.1      # std of the full-rank part relative to the low-rank part
    gate_scale: float = 16.0     # gate magnitude: larger -> SiLU(g) closer to ReLU(g)
    qtype: str = "Q4_0"
    seed: int = 0
    sample_seqs: int = 16        # half calibrate, half measure
    sample_len: int = 64
    attn_out_rms: float = 0.1    # layer outputs relative to the residual's rms (1)
    ffn_out_rms: float = 0.15
    logit_std: float = 3.0

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise TandemError(f"--qtype must be one of {', '.join(QTYPES)}, got {self.qtype!r}")
        if self.gate_rank < 1 or self.sample_seqs < 2 or self.sample_len < 2:
            raise TandemError("gate rank, sample sequences and sample length must be positive (>= 2 sequences)")
        if not (math.isfinite(self.gate_scale) and math.isfinite(self.gate_noise)) or self.gate_scale <= 0 \
                or self.gate_noise < 0:  # (nan / inf made a degenerate model and bare NaN in its sidecar JSON)
            raise TandemError(f"gate scale must be finite and > 0 and --gate-noise finite and >= 0, got "
                              f"{self.gate_scale} and {self.gate_noise}")
        most = (self.shape.hidden - BIAS_DIMS) // 2  # the gate's low-rank part lives in half the input dimensions
        if self.gate_rank > most:
            raise TandemError(f"--gate-rank must be at most {most} for shape {self.shape.name}, got {self.gate_rank}")
        if not 0 <= self.seed < 2**63:
            raise TandemError(f"--seed must be in [0, 2^63), got {self.seed}")
        firing_rates(64, self.sparsity, self.hot_fraction, self.hot_share)  # validates the request

    def request(self) -> dict:
        d = asdict(self)
        d["shape"] = self.shape.name
        return d


@dataclass(frozen=True)
class SynthResult:
    path: Path
    stats: dict = field(default_factory=dict)


def default_file_name(spec: SynthSpec) -> str:
    return f"{spec.shape.name}-synthetic-s{round(spec.sparsity * 100)}.{spec.qtype}.gguf"


def synthesize(spec: SynthSpec, out_dir: str | Path, tokenizer_gguf: str | Path, progress=None) -> SynthResult:
    """Write DIR/<shape>-synthetic-s<NN>.<qtype>.gguf (+ .synth.json); returns its path and statistics."""
    from tandem.core.loading.gguf_loader import read_gguf

    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TandemError(f"cannot create output directory {out_dir}: {e.strerror or e}") from None
    _, fields = read_gguf(tokenizer_gguf)
    vocab = len(fields.get("tokenizer.ggml.tokens") or [])
    if vocab < 2:
        raise TandemError(f"{tokenizer_gguf} has no tokenizer vocabulary")
    path = out_dir / default_file_name(spec)
    tmp = out_dir / f".{path.name}.tmp"
    shape, rng = spec.shape, np.random.default_rng(spec.seed)
    torch.manual_seed(spec.seed)
    try:
        with StreamingGGUF(tmp, spec, fields, tensor_plan(shape, vocab, spec.qtype)) as out:
            stats = _write_layers(spec, shape, vocab, rng, out, progress)
            out.patch_stats(stats["summary"])
        sidecar = path.with_name(path.name + ".synth.json")
        tmp_json = sidecar.with_name("." + sidecar.name + ".tmp")
        tmp_json.write_text(json.dumps({"synthetic_weights": True, "request": spec.request(), **stats}, indent=1))
        os.replace(tmp, path)
        os.replace(tmp_json, sidecar)
    except BaseException as e:
        for p in (tmp, out_dir / f".{path.name}.synth.json.tmp"):
            p.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise TandemError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    return SynthResult(path=path, stats=stats)


def _write_layers(spec: SynthSpec, shape: Shape, vocab: int, rng, out: "StreamingGGUF", progress) -> dict:
    d, S, T = shape.hidden, spec.sample_seqs, spec.sample_len
    n_cal = S // 2 * T
    emb = gaussian(rng, (vocab, d), 1.0)
    emb[:, :BIAS_DIMS] = 1.0
    blocks, emb_deq = roundtrip(emb, spec.qtype)
    del emb
    out.write(blocks)
    ids = torch.from_numpy(rng.integers(0, vocab, size=(S, T)))
    h = emb_deq[ids.reshape(-1)].reshape(S, T, d).clone()  # [S, T, d] residual stream
    del emb_deq, blocks
    cos, sin = rope_tables(shape.head_dim, T, shape.rope_theta)
    ones = np.ones((1, d), np.float32)
    layers = []
    for layer in range(shape.n_layers):
        out.write(ones.view(np.uint8))  # attn_norm
        att_blocks, att = attention(rng, shape, spec.qtype, h, spec.attn_out_rms, cos, sin)
        for stem in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out.write(att_blocks[stem])
        h = h + att
        out.write(ones.view(np.uint8))  # ffn_norm
        xn = rms_norm(h).reshape(S * T, d)  # [N, d]
        if shape.n_experts:
            delta, stat = _moe_layer(spec, shape, rng, xn, n_cal, out)
        else:
            delta, stat = _dense_layer(spec, shape, rng, xn, n_cal, out)
        h = h + delta.reshape(S, T, d)
        stat["layer"] = layer
        layers.append(stat)
        if progress:
            progress(f"layer {layer + 1}/{shape.n_layers}: sparsity {stat['sparsity']:.3f}, "
                     f"hot share {stat['hot_share']:.3f} (synthetic weights)")
    out.write(ones.view(np.uint8))  # output_norm
    head = gaussian(rng, (vocab, d), spec.logit_std / math.sqrt(d))
    head[:, :BIAS_DIMS] = 0.0
    out.write(roundtrip(head, spec.qtype)[0])
    return {"layers": layers, "summary": _summary(spec, layers)}


def _ffn_expert(spec, shape, rng, xn_cal: torch.Tensor, xn: torch.Tensor):
    """One sparse FFN: quantized blocks and its output / activity on every sample token."""
    rates = firing_rates(shape.n_ff, spec.sparsity, spec.hot_fraction, spec.hot_share, rng)
    f = sparse_ffn(rng, spec, shape.hidden, shape.n_ff, rates, xn_cal)
    gq, gate = roundtrip(f["gate"], spec.qtype)
    uq, up = roundtrip(f["up"], spec.qtype)
    down = f["down"]
    raw, _ = ffn_apply(gate, up, torch.from_numpy(down), xn_cal)
    down *= spec.ffn_out_rms / max(float(raw[:, BIAS_DIMS:].pow(2).mean().sqrt()), 1e-12)
    dq, down_deq = roundtrip(down, spec.qtype)
    y, active = ffn_apply(gate, up, down_deq, xn)
    y_silu, _ = ffn_apply(gate, up, down_deq, xn, silu=True)
    return (gq, uq, dq), y, active, y_silu, f


def _activity_stats(spec, active: torch.Tensor, y: torch.Tensor, y_silu: torch.Tensor, f: dict) -> dict:
    rates = active.float().mean(0).numpy()
    gap = float((y_silu - y).norm() / y.norm().clamp_min(1e-12))
    return {"sparsity": float(1.0 - rates.mean()), "hot_share": hot_share_of(rates, spec.hot_fraction),
            "silu_relu_gap": gap, "gate_rank": f["rank"], "lowrank_variance_share": f["lowrank_share"],
            "tokens": int(active.shape[0])}


def _dense_layer(spec, shape, rng, xn, n_cal, out):
    blocks, y, active, y_silu, f = _ffn_expert(spec, shape, rng, xn[:n_cal], xn)
    for b in blocks:
        out.write(b)
    return y, _activity_stats(spec, active[n_cal:], y[n_cal:], y_silu[n_cal:], f)


def _moe_layer(spec, shape, rng, xn, n_cal, out):
    E, k = shape.n_experts, shape.n_experts_used
    router = gaussian(rng, (E, shape.hidden), 2.0 / math.sqrt(shape.hidden))
    router[:, :BIAS_DIMS] = 0.0
    out.write(router.view(np.uint8))  # ffn_gate_inp, F32
    top_v, top_i = torch.topk(xn @ torch.from_numpy(router).T, k, dim=-1)  # [N, k]
    weights = torch.softmax(top_v, -1)
    y, y_silu = torch.zeros_like(xn), torch.zeros_like(xn)
    per_proj, stats = ([], [], []), []
    for e in range(E):
        routed = (top_i == e).any(-1)  # [N]
        w_e = (weights * (top_i == e)).sum(-1, keepdim=True)  # [N, 1]
        cal = xn[:n_cal][routed[:n_cal]]
        cal = cal if cal.shape[0] >= 64 else xn[:n_cal]
        blocks, ye, active, ye_silu, f = _ffn_expert(spec, shape, rng, cal, xn)
        for proj, b in zip(per_proj, blocks):
            proj.append(b)
        y += w_e * ye
        y_silu += w_e * ye_silu
        held = routed.clone()
        held[:n_cal] = False
        if held.any():
            stats.append(_activity_stats(spec, active[held], ye[held], ye_silu[held], f))
    for proj in per_proj:
        out.write(np.stack(proj))  # [E, rows, row_bytes]
    stat = {key: float(np.mean([s[key] for s in stats])) for key in ("sparsity", "hot_share", "lowrank_variance_share")}
    stat.update(silu_relu_gap=float((y_silu[n_cal:] - y[n_cal:]).norm() / y[n_cal:].norm().clamp_min(1e-12)),
                gate_rank=stats[0]["gate_rank"], tokens=int(xn.shape[0] - n_cal), experts_measured=len(stats))
    return y, stat


def _summary(spec: SynthSpec, layers: list[dict]) -> dict:
    sp = [s["sparsity"] for s in layers]
    hs = [s["hot_share"] for s in layers]
    mean_sp, mean_hs = float(np.mean(sp)), float(np.mean(hs))
    ok = abs(mean_sp - spec.sparsity) <= SPARSITY_TOLERANCE and abs(mean_hs - spec.hot_share) <= HOT_SHARE_TOLERANCE
    return {"synthetic_weights": True, "requested_sparsity": spec.sparsity, "sparsity": mean_sp,
            "sparsity_min": float(min(sp)), "sparsity_max": float(max(sp)),
            "requested_hot_share": spec.hot_share, "hot_fraction": spec.hot_fraction, "hot_share": mean_hs,
            "silu_relu_gap_max": float(max(s["silu_relu_gap"] for s in layers)),
            "tolerances": {"sparsity": SPARSITY_TOLERANCE, "hot_share": HOT_SHARE_TOLERANCE},
            "within_tolerance": bool(ok), "measured_on": "held-out sample sequences (random token ids), float forward "
                                                       "of the dequantized weights"}
