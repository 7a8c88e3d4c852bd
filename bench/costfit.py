"""Modeled vs measured decode tok/s of CPU plans, the probe and the decodes interleaved (issue 13).

Every engine is loaded once (no step cache written). In each round every plan decodes ``--tokens``
greedy tokens per mode right after `tandem probe --fused`'s measurement (read bandwidth, the row
kernels' rates per packed format and access, fixed costs) of the formats it reads, so contention hits
the probe and the decodes alike. Modeled = the plan's reads by packed format and access
(placement.step_reads: the step's real packed tensors x the row shares its profile / predictors give)
at the measured rates, plus the fixed costs. Reported best of rounds (contention only slows a run) and
the per-round ratios. Also printed: the plan's raw cost model (nominal bytes per weight, its hardware
file) and the previous calibrated model (nominal bytes at the int4 term).

    .venv/bin/python -m bench.costfit --rounds 5          # -> bench/costfit.md
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.cli_errors import run_main
from tandem.core.errors import TandemError

os.environ.setdefault("GOMP_SPINCOUNT", "30000")  # as the tandem CLI (tandem/cli.py), before the kernels load

HEADING = "## Cost model check, {threads} thread(s): modeled vs measured tok/s by packed format (`python -m bench.costfit`, issue 13)"
SYN = Path("bench/synthetic-models")
PLANS = {  # name: (model, plan, profile, predictors, modes)
    "smollm2": ("models/SmolLM2-135M-Instruct.Q4_1.gguf", "profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0",
                "profiles/SmolLM2-135M-Instruct.Q4_1/profile", None, ("plan",)),
    "gemma3": ("models/gemma-3-270m-q4_k_m.gguf", "profiles/gemma3-full/plan-cpu-only-0",
               "profiles/gemma3-full/profile", None, ("plan",)),
    "llama-1b-s90": (SYN / "llama-1b-synthetic-s90.Q4_0.gguf", SYN / "llama-1b-synthetic-s90.Q4_0/plan",
                     SYN / "llama-1b-synthetic-s90.Q4_0/profile", SYN / "llama-1b-synthetic-s90.Q4_0/predictors",
                     ("dense", "relu-exact", "predictor")),
    "llama-1b-s50": (SYN / "llama-1b-synthetic-s50.Q4_0.gguf", SYN / "llama-1b-synthetic-s50.Q4_0/plan",
                     SYN / "llama-1b-synthetic-s50.Q4_0/profile", SYN / "llama-1b-synthetic-s50.Q4_0/predictors",
                     ("relu-exact", "predictor")),
}
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def load(name: str, threads: int) -> dict:
    from offline.profile_artifact import load_profile
    from online import Engine
    from online.step_inventory import step_units
    from placement.plan import read_plan
    from placement.predictor_info import load_predictor_info
    from placement.settings import ActivationStats
    from placement.step_reads import layer_fractions

    model, plan, profile, preds, modes = PLANS[name]
    engine = Engine.load(str(model), plan=str(plan), predictors=str(preds) if preds else None, threads=threads,
                         step_cache=False)
    if engine.decode_path != "fused":
        raise SystemExit(f"{name}: no fused decode ({engine.decode_path_reason})")
    cfg, step = engine.config, engine.compiled_decode
    stats = ActivationStats.from_profile(load_profile(profile), cfg)
    info = load_predictor_info(preds, cfg.num_layers) if preds else None
    return dict(name=name, engine=engine, step=step, units=step_units(step, cfg), modes=modes, relu=stats.activity == "relu",
                exact=layer_fractions(stats.activity, stats.neuron_freq, None),
                predicted=layer_fractions(stats.activity, stats.neuron_freq, info), plan=read_plan(plan),
                preds=[ctypes.pointer(layer.pred.contents) if layer.pred else None for layer in step._layers],
                thresholds=[layer.threshold for layer in step._layers])


def set_mode(p: dict, mode: str):
    """Toggle the step's thresholds / predictors (bench/systems/tandem_synthetic.py); the mode's row fractions."""
    from online.kernels.native.structs import TdmPredictor

    null = ctypes.POINTER(TdmPredictor)()
    for i, layer in enumerate(p["step"]._layers):
        layer.threshold = -1.0 if mode == "dense" else p["thresholds"][i]
        layer.pred = p["preds"][i] if mode in ("plan", "predictor") and p["preds"][i] else null
    if mode == "dense":
        return None
    return p["exact"] if mode == "relu-exact" else p["predicted"]


def measure(p: dict, tokens: int) -> float:
    out = p["engine"].generate(PROMPT, max_new_tokens=tokens, ignore_eos=True)
    return float(out.stats["decode_tokens_per_s"])


def best_token_s(p: dict, tokens: int, mode: str):
    """(the fastest single step of ``tokens``, the row fractions those steps read as the step counted them).
    The step alone, no sampling: the decode's counterpart of the probe's best pass (ms-scale windows
    without other processes on the cores)."""
    from placement.step_reads import LayerFractions

    engine, step, counters = p["engine"], p["engine"].compiled_decode, p["engine"].executor.counters
    cache = engine._kv_cache(tokens + 1)
    act0, tot0, rows0 = counters.ffn_neurons_active, counters.ffn_neurons_total, step.predictor_rows()
    best = float("inf")
    for pos in range(tokens):
        t0 = time.perf_counter()
        step(1 + pos % 100, pos, cache)
        best = min(best, time.perf_counter() - t0)
    total, rows = counters.ffn_neurons_total - tot0, step.predictor_rows()
    down = (counters.ffn_neurons_active - act0) / total
    if mode == "dense":
        counted = None
    elif mode == "predictor" or (mode == "plan" and any(p["preds"])):
        counted = LayerFractions((rows[0] - rows0[0]) / total, (rows[1] - rows0[1]) / total, down, predicted=True)
    else:
        counted = LayerFractions(1.0, down if p["relu"] else 1.0, down)
    return best, counted


def interleaved_ratio(p: dict, reads: dict, shares: dict, passes: int, cal, threads: int,
                      pairs: int) -> tuple[float, float, float]:
    """Modeled / measured tok/s from ``pairs`` back-to-back pairs, contention hitting both alike: A = the
    modeled token (one probe pass per format and access the mode reads, scaled to its bytes, the reads repeated
    every token over the cache's speedup at the mode's bytes per token, plus the fixed costs of ``cal`` and its
    ``passes`` matrix passes), B = one decode step. (median, min, max) of step seconds / modeled seconds."""
    import numpy as np

    from online.kernels.native import load_native
    from online.kind_probe import plan_for, read_pass

    lib, rng, total = load_native().lib, np.random.default_rng(1), sum(reads.values())
    probes = []
    for (kind, access), nbytes in reads.items():
        if nbytes < 0.005 * total:  # the embedding row and the like: below the noise
            continue
        fmt, acc = plan_for([(kind, access)])[0]
        one = read_pass(lib, fmt, acc, threads, rng, share=shares[(kind, access)], picks=4)  # as the probe times it
        one()  # warm-up
        probes.append((one, nbytes / one.nbytes / cal.access_speedup(access, total)))
    n_layers = p["engine"].config.num_layers
    term = cal.term("int4")
    fixed = term.call_s + n_layers * term.layer_s + passes * cal.pass_s
    engine = p["engine"]
    cache = engine._kv_cache(pairs + 2)
    engine.compiled_decode(1, 0, cache)  # warm-up
    ratios = []
    for i in range(pairs):
        modeled = fixed + sum(one() * scale for one, scale in probes)
        t0 = time.perf_counter()
        engine.compiled_decode(2 + i % 100, 1 + i, cache)
        ratios.append((time.perf_counter() - t0) / modeled)
    return statistics.median(ratios), min(ratios), max(ratios)


def main() -> None:
    from bench.run import assemble_results, machine_line
    from online.plan_measure import fixed_cost_engines, measure_fused_calibration
    from placement.fused_calibration import best_of, calibrated_plan_tokens_per_s
    from placement.step_reads import (WHOLE_ACCESSES, format_reads, modeled_passes, modeled_reads, modeled_rows,
                                      read_fractions)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=24, help="interleaved (modeled token, decode step) pairs per mode")
    ap.add_argument("--out", default="bench/costfit.md")
    args = ap.parse_args()
    unknown = [n for n in args.plans.split(",") if n not in PLANS]
    if unknown:
        raise TandemError(f"unknown plan {', '.join(unknown)} (have {', '.join(PLANS)})")
    plans = [load(n, args.threads) for n in args.plans.split(",")]
    rows: dict = {}
    for p in plans:
        p["needed"] = sorted({key for mode in p["modes"] for key in modeled_reads(p["units"], set_mode(p, mode), p["relu"])})
        for mode in p["modes"]:
            set_mode(p, mode)
            measure(p, 4)  # warm-up
    tmp = tempfile.TemporaryDirectory(prefix="costfit-")
    engines = fixed_cost_engines(args.threads, Path(tmp.name))
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for p in plans:  # each plan's decodes right after a probe of the formats it reads
            cal = measure_fused_calibration(args.threads, reads=p["needed"], engines=engines)
            p.setdefault("cals", []).append(cal)
            n_layers = p["engine"].config.num_layers
            for mode in p["modes"]:
                fractions = set_mode(p, mode)
                reads, shares = modeled_reads(p["units"], fractions, p["relu"]), read_fractions(p["units"], fractions, p["relu"])
                passes = modeled_passes(p["units"], fractions, p["relu"])
                n_rows = modeled_rows(p["units"], fractions, p["relu"])
                rec = rows.setdefault((p["name"], mode), dict(modeled=[], measured=[], old=[], step=[], counted=[], reads=reads,
                                                              shares=shares, passes=passes, rows=n_rows, p=p))
                rec["modeled"].append(1.0 / cal.reads_seconds(n_layers, reads, fractions=shares, passes=passes,
                                                              rows=n_rows))
                rec["old"].append(calibrated_plan_tokens_per_s(p["plan"], cal, "int4") if mode == "plan" else float("nan"))
                rec["measured"].append(measure(p, args.tokens))
                best_s, counted = best_token_s(p, args.tokens, mode)
                rec["step"].append(best_s)
                n = p["engine"].config.num_layers
                rec["counted"].append(sum(modeled_reads(p["units"], None if counted is None else [counted] * n,
                                                        p["relu"]).values()))
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds} done ({time.strftime('%H:%M:%S')}, load {loads[-1]:.1f})", flush=True)
    for (name, mode), rec in rows.items():  # the A/B pairs, at the best rates of the plan's rounds
        set_mode(rec["p"], mode)
        rec["ab"] = interleaved_ratio(rec["p"], rec["reads"], rec["shares"], rec["passes"], best_of(rec["p"]["cals"]),
                                      args.threads, args.pairs)
    med = statistics.median
    bw = max(c.read_bandwidth_bytes_per_s for p in plans for c in p["cals"]) / 1e9
    lines = [HEADING.format(threads=args.threads), "", f"- Date: {time.strftime('%Y-%m-%d %H:%M')} UTC; machine: {machine_line()}; command: "
             f"`python -m bench.costfit --rounds {args.rounds} --tokens {args.tokens} --threads {args.threads}`.", "",
             f"{args.threads} threads; {args.rounds} rounds; in each, every plan "
             f"right after a probe of the formats it reads (`tandem probe --fused`'s measurement: read bandwidth, per-format "
             f"row-kernel rates, fixed costs) decodes {args.tokens} greedy tokens per mode. **Best of rounds** (contention only "
             f"slows a run): modeled from each rate's fastest round (placement.fused_calibration.best_of; best read "
             f"bandwidth {bw:.1f} GB/s), measured = the fastest round; per-round ratios' median and range beside them. "
             "Raw = the plan's cost model (nominal bytes, its hardware file); previous = nominal bytes at the fused int4 term. "
             "Measured = `generate`'s decode tok/s; best step = 1 / the fastest single step of all rounds (no sampling; the "
             f"probe's best pass is its counterpart). 1-minute load average at the start and after each round: "
             f"{', '.join(f'{x:.1f}' for x in loads)}.", "",
             "Modeled MB/token: the profile's (and predictors') row shares; counted: the shares the step's own "
             "counters report over the timed steps (all layers at their mean), same packed tensors.", "",
             f"**Interleaved A/B** (the measure that survives contention): {args.pairs} back-to-back pairs of A = one "
             "modeled token (one pass of the probe's row kernel per format and access the mode reads, its time scaled "
             "to the mode's bytes, plus the fixed costs) and B = one decode step; median (range) of B's seconds / A's "
             "= modeled / measured tok/s. With 2 threads on a loaded host the step's many OpenMP barriers per token "
             "wait on the scheduler (a step measured 188 ms alone where a probe pass of half its bytes took 5 ms), "
             "which one join per probe pass does not: contended 2-thread ratios overstate; 1 thread has no barriers. "
             "Not modeled: `generate`'s own per-token work beyond the step (sampling, detokenizing; the tiny models' "
             "fixed costs have no tokenizer): compare `generate` with the best step in the same row.", "",
             "| plan | mode | raw model | previous calibrated | modeled by format (best) | measured (best) | "
             "modeled / measured (best) | per-round ratio median (range) | best step tok/s (modeled / it) | "
             "**interleaved A/B modeled / measured** | MB/token modeled / counted | reads per token (format, access) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, mode), rec in rows.items():
        p = rec["p"]
        best = 1.0 / best_of(p["cals"]).reads_seconds(p["engine"].config.num_layers, rec["reads"], fractions=rec["shares"],
                                                      passes=rec["passes"], rows=rec["rows"])
        ratios = [m / x for m, x in zip(rec["modeled"], rec["measured"])]
        lines.append(f"| {name} | {mode} | {p['plan'].modeled['tokens_per_s']:.1f} | {max(rec['old']):.1f} | "
                     f"{best:.1f} | {max(rec['measured']):.1f} | **{best / max(rec['measured']):.2f}** | {med(ratios):.2f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) | {1 / min(rec['step']):.1f} ({best * min(rec['step']):.2f}) | "
                     f"**{rec['ab'][0]:.2f}** ({rec['ab'][1]:.2f}-{rec['ab'][2]:.2f}) | {sum(rec['reads'].values()) / 1e6:.0f} / {med(rec['counted']) / 1e6:.0f} | {format_reads(rec['reads'])} |")
    cal = best_of([c for p in plans for c in p["cals"]])
    lines += ["", "Best rates (share of the best read bandwidth): " + ", ".join(
        f"{r.kind} {r.access}{'' if r.access in WHOLE_ACCESSES else f' {r.fraction:.0%}'} {r.share:.2f}" for r in cal.rates) + "; fixed: " + ", ".join(
        f"{t.weight_format} {1e6 * t.call_s:.0f} us/call {1e6 * t.layer_s:.1f} us/layer" for t in cal.terms)
        + f"; {1e6 * cal.pass_s:.2f} us per matrix pass"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    if Path(args.out).resolve() == (Path(__file__).resolve().parent / "costfit.md"):
        assemble_results()
    print("\n".join(lines))


if __name__ == "__main__":
    run_main(main)
