"""Tandem's fused decode step on a synthetic-weights GGUF: dense, exact-ReLU and predictor-gated rows.

One engine (the cpu-only plan with predictors) is loaded once; the three modes toggle the step's
per-layer threshold and predictor pointer. For each mode: decode tok/s (greedy, after a module-path
prefill of the benchmark prompt), FFN rows read and the weight bytes read per token, and the
bytes-limit tok/s (weight and KV-cache bytes per token against the median of the runs' read bandwidths,
each the mean of samples right before and right after the run, in the same process; the weights-only limit
beside it). The modes are timed round by round, so each sees the host's states alike.
"""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.prompt import BENCH_PROMPT  # noqa: E402
from bench.systems.common import emit, timing_arguments  # noqa: E402


def ffn_bytes(engine) -> tuple[float, float, float, float]:
    """(gate, up bytes per neuron row, sparse down bytes per neuron row x the share of layers with sparse down
    rows, the rest: every byte read whatever the rows: attention, output layer, dense GGUF downs)."""
    splits = engine.executor.splits
    n_ff = splits[0].cpu.n_neurons
    gate = sum(s.cpu.gate.nbytes for s in splits) / len(splits) / n_ff
    up = sum(s.cpu.up.nbytes for s in splits) / len(splits) / n_ff
    sparse = [s for s in splits if s.cpu.down is None]  # the others read their GGUF down whole (dense_down_wanted)
    down = sum(s.cpu.down_t.nbytes for s in sparse) / len(splits) / n_ff  # per active row, all layers averaged
    ffn_total = sum(s.cpu.gate.nbytes + s.cpu.up.nbytes + (s.cpu.down_t.nbytes if s.cpu.down is None else 0)
                    for s in splits)
    return gate, up, down, engine.weight_bytes_per_token - ffn_total


def set_mode(step, mode: str, preds: list) -> None:
    """Toggle the step's per-layer threshold and predictor pointer to ``mode``."""
    from online.kernels.native.structs import TdmPredictor

    null = ctypes.POINTER(TdmPredictor)()
    for i, layer in enumerate(step._layers):
        layer.threshold = -1.0 if mode == "dense" else 0.0
        layer.pred = preds[i] if mode == "predictor" and preds[i] else null


def run_modes(engine, step, modes: tuple[str, ...], ids: list[int], n_tokens: int, runs: int, preds: list,
              bandwidth) -> list[dict]:
    """Time ``modes`` round by round (a warm-up round, then ``runs`` rounds of every mode in turn), so each
    mode sees the host's states alike. ``bandwidth()``: the read bandwidth now, sampled right before and right
    after every counted run; the run's bandwidth is the mean of the two (the host's bandwidth drifts by a third
    within minutes, and a single sample beside a run missed a fifth of it either way)."""
    from tandem.core.generate import prefill

    counters = engine.executor.counters
    recs = {m: {"mode": m, "decode_tok_s": [], "read_bandwidth_samples": [], "read_bandwidth_after": []}
            for m in modes}
    sums = {m: [0, 0, 0, 0] for m in modes}  # active, total, predicted, computed
    for run in range(runs + 1):
        for mode in modes:
            set_mode(step, mode, preds)
            rec, acc = recs[mode], sums[mode]
            cache = engine._kv_cache(len(ids) + n_tokens + 1)
            tok = int(prefill(engine.model, engine.executor, cache, ids).argmax())
            act0, tot0, rows0 = counters.ffn_neurons_active, counters.ffn_neurons_total, step.predictor_rows()
            before = bandwidth() if run else None
            t0 = time.perf_counter()
            for i in range(n_tokens):
                tok = int(step(tok, len(ids) + i, cache).argmax())
            elapsed = time.perf_counter() - t0
            if run:  # the first round warms up
                rec["read_bandwidth_after"].append(bandwidth())
                rec["read_bandwidth_samples"].append(before)
                rec["decode_tok_s"].append(n_tokens / elapsed)
                rows = step.predictor_rows()
                acc[0] += counters.ffn_neurons_active - act0
                acc[1] += counters.ffn_neurons_total - tot0
                acc[2] += rows[0] - rows0[0]
                acc[3] += rows[1] - rows0[1]
    steps = runs * n_tokens
    for mode in modes:
        active, total, predicted, computed = sums[mode]
        recs[mode].update(down_rows=active / steps, predicted_rows=predicted / steps, computed_up_rows=computed / steps,
                          neurons=total / steps)
    return [recs[m] for m in modes]


def run_bandwidths(rec: dict) -> list[float]:
    """Each run's read bandwidth: the mean of the samples before and after it (records from before 2026-11-29
    hold only the sample before)."""
    after = rec.get("read_bandwidth_after") or rec["read_bandwidth_samples"]
    return [(b + a) / 2 for b, a in zip(rec["read_bandwidth_samples"], after)]


def counted_reads(engine, step, mode: str, rec: dict, context_tokens: float) -> tuple[dict, dict, int, dict]:
    """(bytes per token, row share) by (packed format, access) of this mode (placement.step_reads), every
    layer at the row shares the run counted, the KV cache at the run's mean context, the matrix passes
    per token, and the rows read per token by (format, access)."""
    from online.step_inventory import step_units
    from placement.step_reads import LayerFractions, step_read_terms

    total = rec["neurons"]
    down = rec["down_rows"] / total
    fractions = {"dense": None, "relu-exact": LayerFractions(1.0, down, down),
                 "predictor": LayerFractions(rec["predicted_rows"] / total, rec["computed_up_rows"] / total, down, True)}[mode]
    units, layers = step_units(step, engine.config), None if fractions is None else [fractions] * engine.config.num_layers
    return step_read_terms(units, layers, True, engine.config, context_tokens, engine.kv_cache_type)


def modeled(cal, engine, step, mode: str, rec: dict, context: float, read_bytes: float) -> dict:
    """Modeled tok/s of one mode: the calibration's fixed costs and its kernels' shares of the read bandwidth,
    applied to each run's bandwidth (``modeled_tok_s_runs``; their median ``modeled_tok_s``; the median of the
    runs' modeled / measured ``modeled_over_measured``, each run against the model at its own bandwidth) and to
    the bandwidth of the calibration's own probe (``modeled_tok_s_probe_bandwidth``). The shares are what the
    model claims; the host's bandwidth is an input that drifts by a third within minutes here, as the bytes
    limit's does."""
    from dataclasses import replace

    if cal.rates:  # the step's own tensors at the rows counted, priced under both bandwidths below
        reads, shares, passes, rows = counted_reads(engine, step, mode, rec, context)

    def tok_s(c) -> float:
        if not c.rates:  # files from before the per-format rates: one share per weight format
            return 1.0 / c.step_seconds(engine.executor.settings.weight_format, engine.config.num_layers, read_bytes)
        return 1.0 / c.reads_seconds(engine.config.num_layers, reads, fractions=shares, passes=passes, rows=rows)

    runs = [tok_s(replace(cal, read_bandwidth_bytes_per_s=b)) for b in run_bandwidths(rec)]
    return {"modeled_tok_s": statistics.median(runs), "modeled_tok_s_runs": runs,
            "modeled_over_measured": statistics.median(m / d for m, d in zip(runs, rec["decode_tok_s"])),
            "modeled_tok_s_probe_bandwidth": tok_s(cal), "calibration_bandwidth": cal.read_bandwidth_bytes_per_s}


def main() -> None:
    ap = timing_arguments(__doc__)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--predictors", required=True)
    ap.add_argument("--calibration", help="fused-step calibration (tandem probe --fused): modeled tok/s per mode")
    ap.add_argument("--down-format", default=None, help="storage of the sparse down rows (default: the engine's, fp16)")
    args = ap.parse_args()
    from online import Engine
    from placement.fused_calibration import load_calibration
    from placement.probe import measure_read_bandwidth
    from placement.step_reads import kv_read_bytes
    import torch

    engine = Engine.load(args.gguf, threads=args.threads, plan=args.plan, predictors=args.predictors,
                         **({"down_format": args.down_format} if args.down_format else {}))
    if engine.decode_path != "fused":
        raise SystemExit(f"no fused decode: {engine.decode_path_reason}")
    torch.set_num_threads(args.threads)
    step = engine.compiled_decode
    # independent pointer objects (a field read shares the struct's memory and would follow the toggles)
    preds = [ctypes.pointer(layer.pred.contents) if layer.pred else None for layer in step._layers]
    ids = engine.tokenizer.encode(BENCH_PROMPT)[:64]
    gate_b, up_b, down_b, rest = ffn_bytes(engine)
    pred_bytes = sum(r.desc.w1.rows * r.desc.w1.row_bytes + r.desc.w2.rows * r.desc.w2.row_bytes
                     for r in step._keep if hasattr(r, "predicted"))
    n_layers, n_ff = engine.config.num_layers, engine.executor.splits[0].cpu.n_neurons
    context = len(ids) + (args.decode_tokens + 1) / 2  # keys each decode step attends to, on average
    kv = kv_read_bytes(engine.config, context, engine.kv_cache_type)  # keys and values: read by every mode alike
    modes = ("dense", "relu-exact", "predictor")
    out = run_modes(engine, step, modes, ids, args.decode_tokens, args.runs, preds,
                    lambda: measure_read_bandwidth("cpu"))
    for rec in out:
        mode = rec["mode"]
        bandwidth = statistics.median(run_bandwidths(rec))  # beside this mode's runs
        if mode == "dense":
            gate_rows = up_rows = down_rows = n_layers * n_ff
            extra = 0
        elif mode == "relu-exact":
            gate_rows, up_rows, down_rows, extra = n_layers * n_ff, rec["down_rows"], rec["down_rows"], 0
        else:
            gate_rows, up_rows, down_rows, extra = rec["predicted_rows"], rec["computed_up_rows"], rec["down_rows"], pred_bytes
        read = rest + extra + gate_rows * gate_b + up_rows * up_b + down_rows * down_b
        rec.update(bytes_per_token=read, kv_bytes_per_token=kv, bytes_limit_tok_s=bandwidth / (read + kv),
                   weights_limit_tok_s=bandwidth / read, read_bandwidth=bandwidth, predictor_bytes=extra,
                   sparsity=1 - rec["down_rows"] / (n_layers * n_ff))
        rec["decode_tok_s_median"] = statistics.median(rec["decode_tok_s"])
        if args.calibration:
            rec.update(modeled(load_calibration(args.calibration), engine, step, mode, rec, context, read + kv))
    emit({"system": "tandem", "modes": out, "weight_format": engine.executor.settings.weight_format})


if __name__ == "__main__":
    main()
