"""Plan measurements that run the runtime: held-out quality, decode tok/s and the fused step's cost terms.

They load engines, so they live on the online floor; the placement floor keeps the pure parts (windows and
scoring in placement.quality, the fitted terms in placement.fused_calibration) and the CLI passes these in.

Example::

    quality = measure_plan_quality("smollm2", "profiles/m/plan-rtx4090-2GiB", max_tokens=256)
    quality["perplexity_increase"], quality["greedy_agreement"]
    rate, path = measure_plan_tokens_per_s("smollm2", "profiles/m/plan-cpu-only-0", None, threads=2)
    cal = measure_fused_calibration(threads=2)              # ~20 s
"""
from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from placement.fused_calibration import FORMATS, SIZES, FusedCalibration, fit_terms
from placement.plan import read_plan
from placement.probe import measure_read_bandwidth
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
    return {"label": "measured", "held_out_tokens": scored, "perplexity": round(ppl, 6),
            "dense_perplexity": round(dense_ppl, 6), "perplexity_increase": round(ppl / dense_ppl - 1.0, 6),
            "greedy_agreement": round(float((plan_greedy == dense_greedy).float().mean()), 6),
            "max_quality_loss": max_quality_loss, "window_tokens": window, "tier_device": str(planned.executor.tier.device),
            "path": "batched module path (tier units, packed CPU weights, thresholds, predictors)"}


def measure_plan_tokens_per_s(model: str, plan_dir: str, predictors: str | None, threads: int | None) -> tuple[float, str]:
    """(decode tok/s over MEASURE_TOKENS greedy tokens after a short prompt, decode path)."""
    engine = Engine.load(model, threads=threads, plan=plan_dir, predictors=predictors)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    engine.generate(prompt, max_new_tokens=4, ignore_eos=True)  # warm-up (native build, caches)
    t0 = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=MEASURE_TOKENS, ignore_eos=True)
    rate = out.stats.get("decode_tokens_per_s") if hasattr(out, "stats") else None
    if not rate:
        rate = MEASURE_TOKENS / (time.perf_counter() - t0)
    return float(rate), engine.decode_path


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


def measure_fused_calibration(threads: int, formats: tuple[str, ...] = FORMATS) -> FusedCalibration:
    """Time the fused step on three random Llama models per format and fit the three terms."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = measure_read_bandwidth("cpu")
    finally:
        torch.set_num_threads(previous)
    samples = {f: [] for f in formats}
    with tempfile.TemporaryDirectory(prefix="tandem-probe-") as tmp:
        for i, (layers, hidden, ffn) in enumerate(SIZES):
            folder = _random_llama(Path(tmp) / f"m{i}", layers, hidden, ffn)
            for fmt in formats:
                engine = Engine.load(str(folder), threads=threads, weight_format=fmt)
                if engine.decode_path != "fused":
                    raise TandemError(f"no fused decode step here: {engine.decode_path_reason}")
                samples[fmt].append((layers, float(engine.weight_bytes_per_token), _time_step(engine)))
                del engine
    terms = tuple(fit_terms(fmt, samples[fmt], bandwidth) for fmt in formats)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    return FusedCalibration(threads=threads, read_bandwidth_bytes_per_s=bandwidth, terms=terms,
                            description=f"measured by `tandem probe --fused` on {stamp} ({threads} threads)")
