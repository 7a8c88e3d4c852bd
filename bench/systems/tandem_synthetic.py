"""Tandem's fused decode step on a synthetic-weights GGUF: dense, exact-ReLU and predictor-gated rows.

One engine (the cpu-only plan with predictors) is loaded once; the three modes toggle the step's
per-layer threshold and predictor pointer. For each mode: decode tok/s (greedy, after a module-path
prefill of the benchmark prompt), FFN rows read and the weight bytes read per token, and the
bytes-limit tok/s (weight and KV-cache bytes per token against the median read bandwidth sampled
before each of the mode's runs in the same process; the weights-only limit beside it).
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


def run_mode(engine, step, mode: str, ids: list[int], n_tokens: int, runs: int, preds: list, bandwidth) -> dict:
    """``bandwidth()``: the read bandwidth now; it is sampled before every counted run (the host's bandwidth
    drifts by a third within minutes, so one snapshot per process made the bytes limit a lottery)."""
    from tandem.core.generate import prefill
    from online.kernels.native.structs import TdmPredictor

    null = ctypes.POINTER(TdmPredictor)()
    for i, layer in enumerate(step._layers):
        layer.threshold = -1.0 if mode == "dense" else 0.0
        layer.pred = preds[i] if mode == "predictor" and preds[i] else null
    rates, samples, counters = [], [], engine.executor.counters
    active = total = predicted = computed = 0
    for run in range(runs + 1):
        if run:
            samples.append(bandwidth())
        cache = engine._kv_cache(len(ids) + n_tokens + 1)
        tok = int(prefill(engine.model, engine.executor, cache, ids).argmax())
        act0, tot0, rows0 = counters.ffn_neurons_active, counters.ffn_neurons_total, step.predictor_rows()
        t0 = time.perf_counter()
        for i in range(n_tokens):
            tok = int(step(tok, len(ids) + i, cache).argmax())
        elapsed = time.perf_counter() - t0
        if run:  # the first run warms up
            rates.append(n_tokens / elapsed)
            rows = step.predictor_rows()
            active += counters.ffn_neurons_active - act0
            total += counters.ffn_neurons_total - tot0
            predicted += rows[0] - rows0[0]
            computed += rows[1] - rows0[1]
    steps = runs * n_tokens
    return {"mode": mode, "decode_tok_s": rates, "down_rows": active / steps, "predicted_rows": predicted / steps,
            "computed_up_rows": computed / steps, "neurons": total / steps, "read_bandwidth_samples": samples}


def counted_reads(engine, step, mode: str, rec: dict, context_tokens: float) -> tuple[dict, dict, int]:
    """(bytes per token, row share) by (packed format, access) of this mode (placement.step_reads), every
    layer at the row shares the run counted, the KV cache at the run's mean context, and the matrix passes
    per token."""
    from online.step_inventory import step_units
    from placement.step_reads import LayerFractions, step_read_terms

    total = rec["neurons"]
    down = rec["down_rows"] / total
    fractions = {"dense": None, "relu-exact": LayerFractions(1.0, down, down),
                 "predictor": LayerFractions(rec["predicted_rows"] / total, rec["computed_up_rows"] / total, down, True)}[mode]
    units, layers = step_units(step, engine.config), None if fractions is None else [fractions] * engine.config.num_layers
    return step_read_terms(units, layers, True, engine.config, context_tokens, engine.kv_cache_type)


def modeled(cal, engine, step, mode: str, rec: dict, context: float, read_bytes: float, bandwidth: float) -> dict:
    """Modeled tok/s of one mode: the calibration's fixed costs and its kernels' shares of the read bandwidth,
    applied to the bandwidth sampled beside this mode's runs (``modeled_tok_s``) and to the bandwidth of the
    calibration's own probe (``modeled_tok_s_probe_bandwidth``). The shares are what the model claims; the
    host's bandwidth is an input that drifts by a third within minutes here, as the bytes limit's does."""
    from dataclasses import replace

    if cal.rates:  # the step's own tensors at the rows counted, priced under both bandwidths below
        reads, shares, passes = counted_reads(engine, step, mode, rec, context)

    def tok_s(c) -> float:
        if not c.rates:  # files from before the per-format rates: one share per weight format
            return 1.0 / c.step_seconds(engine.executor.settings.weight_format, engine.config.num_layers, read_bytes)
        return 1.0 / c.reads_seconds(engine.config.num_layers, reads, fractions=shares, passes=passes)

    return {"modeled_tok_s": tok_s(replace(cal, read_bandwidth_bytes_per_s=bandwidth)),
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
    out = []
    for mode in ("dense", "relu-exact", "predictor"):
        rec = run_mode(engine, step, mode, ids, args.decode_tokens, args.runs, preds, lambda: measure_read_bandwidth("cpu"))
        bandwidth = statistics.median(rec["read_bandwidth_samples"])  # beside this mode's runs
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
            rec.update(modeled(load_calibration(args.calibration), engine, step, mode, rec, context, read + kv, bandwidth))
        out.append(rec)
    emit({"system": "tandem", "modes": out, "weight_format": engine.executor.settings.weight_format})


if __name__ == "__main__":
    main()
