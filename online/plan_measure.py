"""Plan measurements that run the runtime: held-out quality, decode tok/s and the fused step's cost terms.

They load engines, so they live on the online floor; the placement floor keeps the pure parts (windows and
scoring in placement.quality, the fitted terms in placement.fused_calibration) and the CLI passes these in.

Example::

    quality = measure_plan_quality("smollm2", "profiles/m/plan-rtx4090-2GiB", max_tokens=256)
    quality["perplexity_increase"], quality["greedy_agreement"]
    rate, path = measure_plan_tokens_per_s("smollm2", "profiles/m/plan-cpu-only-0", None, threads=2)
    cal = measure_fused_calibration(threads=2)              # ~40 s
"""
from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from placement.fused_calibration import FIXED_SIZES, FORMATS, FusedCalibration, fit_fixed_terms
from placement.step_reads import modeled_passes, modeled_reads, modeled_rows
from placement.plan import read_plan
from placement.probe import measure_read_bandwidth, torch_threads
from placement.quality import DEFAULT_QUALITY_TOKENS, WINDOW_TOKENS, held_out_tokens, scores
from tandem.core.errors import TandemError

from .engine import Engine

MEASURE_TOKENS = 32


def measure_plan_quality(model: str | Path, plan_dir: str | Path, *, max_tokens: int = DEFAULT_QUALITY_TOKENS,
                         gpu_device: str | None = None, token_docs: list[list[int]] | None = None,
                         max_quality_loss: float | None = None, profile_dir: str | Path | None = None,
                         predictors_dir: str | Path | None = None) -> dict[str, Any]:
    """Perplexity of the plan's runtime and of dense float32 on the same held-out tokens, and how often
    their greedy next-token choices agree."""
    context = read_plan(plan_dir).settings.context_tokens  # the KV cache the plan sized
    dense = Engine.load(str(model))
    window = max(1, min(WINDOW_TOKENS, context - 1, dense.max_context - 1))
    tokens = held_out_tokens(dense, max_tokens, token_docs)
    dense_nll, dense_greedy = scores(dense, tokens, window)
    del dense
    planned = Engine.load(str(model), plan=plan_dir, gpu_device=gpu_device, profile=profile_dir, predictors=predictors_dir)
    plan_nll, plan_greedy = scores(planned, tokens, window)
    scored = len(tokens) - 1
    ppl, dense_ppl = math.exp(plan_nll / scored), math.exp(dense_nll / scored)
    return {"label": "measured", "held_out_tokens": scored, "requested_tokens": max_tokens, "perplexity": round(ppl, 6),
            "dense_perplexity": round(dense_ppl, 6), "perplexity_increase": round(ppl / dense_ppl - 1.0, 6),
            "greedy_agreement": round(float((plan_greedy == dense_greedy).float().mean()), 6),
            "max_quality_loss": max_quality_loss, "window_tokens": window, "tier_device": str(planned.executor.tier.device),
            "path": "batched module path (tier units, packed CPU weights, thresholds, predictors)"}


def measure_plan_tokens_per_s(model: str, plan_dir: str, predictors: str | None, threads: int | None,
                              want_units: bool = False):
    """(decode tok/s over MEASURE_TOKENS greedy tokens after a short prompt, decode path); with
    ``want_units`` also (the fused step's packed tensors, config, the decode steps' mean context in tokens,
    the KV cache's type) for placement.step_reads (None: no fused step)."""
    engine = Engine.load(model, threads=threads, plan=plan_dir, predictors=predictors)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    context = len(prompt) + (MEASURE_TOKENS + 1) / 2  # keys a decode step attends to, on average
    engine.generate(prompt, max_new_tokens=4, ignore_eos=True)  # warm-up (native build, caches)
    t0 = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=MEASURE_TOKENS, ignore_eos=True)
    rate = out.stats.get("decode_tokens_per_s") if hasattr(out, "stats") else None
    if not rate:
        rate = MEASURE_TOKENS / (time.perf_counter() - t0)
    if not want_units:
        return float(rate), engine.decode_path
    step = None
    if engine.decode_path == "fused":
        from .step_inventory import step_units
        try:
            step = (step_units(engine.compiled_decode, engine.config), engine.config, context, engine.kv_cache_type)
        except TandemError:  # MoE layers: reads that follow the router are not modeled by format
            step = None
    return float(rate), engine.decode_path, step


def _random_llama(folder: Path, layers: int, hidden: int, ffn: int) -> Path:
    import torch
    import transformers as tf  # a test/probe-only dependency: imported when a calibration runs

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.utils.logging.disable_progress_bar()
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def _time_step(engine, tokens: int = 64, rounds: int = 5) -> float:
    step = engine.compiled_decode
    cache = engine._kv_cache(tokens + 1)
    step(1, 0, cache)  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for pos in range(tokens):
            step(pos % 512, pos, cache)
        times.append((time.perf_counter() - t0) / tokens)
    return statistics.median(times)


def _time_generate(engine, tokens: int = 16, runs: int = 7) -> float:
    """Seconds per decoded token as ``generate`` reports them (the step plus the token loop's own work),
    the best of ``runs`` short runs (a few ms each on the tiny models: the probe passes' time scale)."""
    rates = [engine.generate([1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=tokens, ignore_eos=True).stats["decode_tokens_per_s"]
             for _ in range(runs)]
    return 1.0 / float(max(rates))


def fixed_cost_engines(threads: int, folder: Path, formats: tuple[str, ...] = FORMATS) -> list[tuple]:
    """(layers, format, engine, units) of tiny random Llama models (FIXED_SIZES) written under ``folder``."""
    from .step_inventory import step_units

    out = []
    for i, (layers, hidden, ffn) in enumerate(FIXED_SIZES):
        path = _random_llama(Path(folder) / f"m{i}", layers, hidden, ffn)
        for fmt in formats:
            engine = Engine.load(str(path), threads=threads, weight_format=fmt)
            if engine.decode_path != "fused":
                raise TandemError(f"no fused decode step here: {engine.decode_path_reason}")
            engine.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True)  # warm-up
            out.append((layers, fmt, engine, step_units(engine.compiled_decode, engine.config)))
    return out


def measure_fused_calibration(threads: int, formats: tuple[str, ...] = FORMATS, reads=None,
                              engines: list | None = None) -> FusedCalibration:
    """The probe's read bandwidth, the row kernels' share of it per packed format and access
    (online.kind_probe), the cost of each matrix pass beyond its bytes (kind_probe.measure_pass_cost), the
    cache's speedup on a working set read again (online.residency_probe), and the fixed costs per call
    and per layer: least squares on what the reads at those rates and the passes leave of tiny random
    Llama models' decode time through ``generate`` (~40 s the first time, ~20 s with ``engines`` from
    fixed_cost_engines). ``reads``: only these (kind, access)
    pairs and the tiny models' own; None: every format the step reads."""
    from .kind_probe import DEFAULT_PLAN, measure_kind_rates_sampled, measure_pass_cost, plan_for
    from .residency_probe import measure_residency

    if engines is None:
        with tempfile.TemporaryDirectory(prefix="tandem-probe-") as tmp:
            return measure_fused_calibration(threads, formats, reads, fixed_cost_engines(threads, Path(tmp), formats))
    fixed_reads = [("q4_1", "dense"), ("q4_1", "dense_gu"), ("int8", "dense"), ("f16", "axpy"), ("f32", "dense")]  # the tiny models'

    def sample() -> float:
        with torch_threads(threads):
            return measure_read_bandwidth("cpu")

    rates, read_samples = measure_kind_rates_sampled(threads, sample, DEFAULT_PLAN if reads is None else
                                                     plan_for([*fixed_reads, *reads]))
    bandwidth = statistics.median(read_samples)  # the shares' denominator (kind_probe)
    pass_s = measure_pass_cost(threads)
    residency = measure_residency(threads)
    partial = FusedCalibration(threads=threads, read_bandwidth_bytes_per_s=bandwidth, terms=(), rates=rates,
                               pass_s=pass_s, residency=residency)
    samples, byte_s = {f: [] for f in formats}, {f: [] for f in formats}
    for layers, fmt, engine, units in engines:
        step_reads = modeled_reads(units, None, relu=False)
        rows = modeled_rows(units, None, relu=False)
        byte_s[fmt].append(partial.reads_seconds(0, step_reads, fixed=False, rows=rows)
                           + modeled_passes(units, None, False) * pass_s)
        samples[fmt].append((layers, float(sum(step_reads.values())), _time_generate(engine)))
    dense_share = {"int4": partial.rate("q4_1", "dense").share, "int8": partial.rate("int8", "dense").share}
    terms = tuple(fit_fixed_terms(fmt, samples[fmt], byte_s[fmt], dense_share.get(fmt, 1.0)) for fmt in formats)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    return FusedCalibration(threads=threads, read_bandwidth_bytes_per_s=bandwidth, terms=terms, rates=rates,
                            description=f"measured by `tandem probe --fused` on {stamp} ({threads} threads; read "
                                        f"bandwidth the median of {len(read_samples)} samples, "
                                        f"{min(read_samples) / 1e9:.1f}-{max(read_samples) / 1e9:.1f} GB/s)",
                            pass_s=pass_s, residency=residency)
