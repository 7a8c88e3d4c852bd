"""MoE expert offloading bench: cache hit rates on routing traces, and modeled Mixtral-8x7B speeds.

Writes two reports:
- ``bench/moe.md``: on two routing traces (a tiny random Mixtral; MoEfied SmolLM2-135M from its
  real weights), the hit rate of LRU alone, LRU + speculative prefetch and the offline optimum
  (Belady's bound), prefetch recall / precision, and bytes moved per token with and without the
  cache. The traces are replayed through the runtime's own ExpertCache and Prefetcher.
- ``bench/modeled_moe.md``: modeled tokens/s for Mixtral-8x7B-shaped offloading on the `t4` and
  `rtx4090` presets (placement's cost model and planner) beside mixtral-offloading's published
  table; every figure there is modeled except the published column.

Usage: .venv/bin/python bench/moe_bench.py [--fit-tokens 1500] [--trace-tokens 2000] [--out bench/moe.md]
                                           [--modeled-out bench/modeled_moe.md]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from bench.modeled_moe import BYTES_PER_WEIGHT, PUBLISHED, REPEAT_RATE, SLOTS, modeled_rows  # noqa: E402
from bench.moe_sim import RoutingTrace, belady, exhaustive_optimum, simulate, trace_statistics  # noqa: E402
from bench.moe_traces import moefication_trace, tiny_mixtral_trace  # noqa: E402
from tandem.core.artifacts import atomic_write_bytes  # noqa: E402

SLOT_COUNTS = (2, 3, 4, 6)


def check_optimum(cases: int = 300, seed: int = 0) -> int:
    """The DP optimum against exhaustive search on small random traces; returns the cases checked."""
    rng = random.Random(seed)
    for _ in range(cases):
        n_experts, k = rng.randint(3, 6), rng.randint(1, 3)
        steps = [sorted(rng.sample(range(n_experts), k)) for _ in range(rng.randint(2, 6))]
        slots = rng.randint(1, 4)
        trace = RoutingTrace("check", [torch.tensor(steps)], [None], n_experts, 1, 1)
        got = round(belady(trace, slots)["hit_rate"] * len(steps) * k)
        want = exhaustive_optimum(steps, slots)
        lru = round(simulate(trace, slots, False)["hit_rate"] * len(steps) * k)
        if got != want or lru > want:
            raise AssertionError(f"optimum check failed on {steps} with {slots} slots: {got} vs {want} (LRU {lru})")
    return cases


def trace_rows(trace: RoutingTrace) -> list[dict]:
    rows = []
    for slots in SLOT_COUNTS:
        lru, pf, opt = simulate(trace, slots, False), simulate(trace, slots, True), belady(trace, slots)
        rows.append({"slots": slots, "lru": lru, "pf": pf, "opt": opt})
    return rows


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def trace_section(trace: RoutingTrace, rows: list[dict], extra: list[str]) -> list[str]:
    stats = trace_statistics(trace)
    n_layers, k, nb = trace.num_layers, trace.top_k, trace.expert_nbytes
    recall = rows[0]["pf"]["recall"]
    lines = [f"### {trace.name}", "",
             f"{n_layers} MoE layers, {trace.num_experts} experts, top-{k}, {trace.num_tokens} tokens in decode order; "
             f"one expert packed in int8 = {nb / 1e3:.0f} KB. Locality: {100 * stats['kept_rate']:.0f}% of a token's "
             f"experts were also used by the previous token (random: {100 * k / trace.num_experts:.0f}%); the 2 busiest "
             f"experts of a layer take {100 * stats['top_quarter_load']:.0f}% of its load (uniform: 25%). "
             f"Prefetch recall (share of a layer's selected experts that the guess one layer earlier contained): "
             f"**{100 * recall:.1f}%**.", *extra, "",
             "| slots per layer | LRU hit rate | LRU + prefetch hit rate | optimum (Belady bound) | prefetch precision "
             "| MB/token copied: LRU | LRU + prefetch (demand + prefetch) | optimum |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lru, pf, opt = r["lru"], r["pf"], r["opt"]
        lines.append(f"| {r['slots']} of {trace.num_experts} | {100 * lru['hit_rate']:.1f}% | {100 * pf['hit_rate']:.1f}% | "
                     f"{100 * opt['hit_rate']:.1f}% | {100 * pf['precision']:.1f}% | {_mb(lru['copies_per_token'] * nb)} | "
                     f"{_mb(pf['copies_per_token'] * nb)} ({_mb(pf['demand_copies_per_token'] * nb)} + "
                     f"{_mb(pf['prefetch_copies_per_token'] * nb)}) | {_mb(opt['copies_per_token'] * nb)} |")
    activations = 2 * trace.d_model * 4 * n_layers
    lines += ["", f"Without a cache: copying each selected expert every time moves {_mb(k * n_layers * nb)} MB/token "
              f"({k * n_layers} expert copies); computing the experts on the CPU where they live (Fiddler) moves only the "
              f"hidden states, {activations / 1e3:.1f} KB/token (x to the CPU and y back, float32, per MoE layer).", ""]
    return lines


def moe_report(tiny: RoutingTrace, tiny_rows: list[dict], moef: RoutingTrace, moef_rows: list[dict], info: dict,
               checked: int, elapsed_s: float) -> str:
    lines = [
        "## MoE expert cache on routing traces (measured on traces; no GPU involved)", "",
        "Each trace is replayed token by token through the runtime's own `ExpertCache` (per-layer LRU, every miss "
        "copied in, as mixtral-offloading) and `Prefetcher` (the guessed experts of layer l+1 are copied in while layer "
        "l runs, evicting the least recently used non-guessed expert; at most `slots` guesses per layer). The optimum is "
        "the best any policy that knows the future can do when every missing expert must be copied in (Belady's bound, "
        f"computed exactly by dynamic programming over cache contents; checked against exhaustive search on {checked} "
        "small random traces). Prefetch can beat it: prefetched experts arrive before they are requested. "
        "MB/token counts expert copies host -> GPU (int8 packed experts).", ""]
    lines += trace_section(tiny, tiny_rows, [
        f"Tiny random Mixtral from transformers' config class (hidden {tiny.notes['hidden']}, expert FFN "
        f"{tiny.notes['expert_ffn']}), {tiny.notes['prompt']}; the guess for layer l+1 is layer l+1's router applied to "
        "layer l's FFN input (the runtime's prefetch)."])
    lines += trace_section(moef, moef_rows, [
        f"MoEfication of SmolLM2-135M-Instruct's real weights: in each of the 30 layers the 1536 FFN neurons are clustered "
        "into 8 experts of 192 by co-activation (scikit-learn KMeans on each neuron's L2-normalised |h| over 768 "
        "calibration tokens, then an equal-size reassignment); each token is routed to the 2 experts holding most of its "
        f"|h| (an oracle router). They hold {100 * info['top2_mass_share']:.1f}% of a token's |h| on average (a random "
        f"equal-size partition: {100 * info['random_partition_top2_mass_share']:.1f}%: this SwiGLU model's co-activation "
        "structure is weak). Prefetch guess for layer l+1: a ridge least-squares map from layer l's FFN input to layer "
        f"l+1's per-expert |h| shares, fitted on {info['fit_tokens']} calibration tokens (shipped corpus, training "
        f"split); the trace is the {info['trace_tokens']} held-out tokens. The same map fitted at layer l+1's own input "
        f"(a MoEfication router) reaches {100 * info['same_layer_router_recall']:.1f}% recall, so looking one layer "
        "ahead costs little."])
    best = max(moef_rows, key=lambda r: r["pf"]["hit_rate"] - r["lru"]["hit_rate"])
    gain = best["pf"]["hit_rate"] - best["lru"]["hit_rate"]
    above_optimum = [r["slots"] for r in moef_rows if r["pf"]["hit_rate"] > r["opt"]["hit_rate"]]
    more_copies = all(r["pf"]["copies_per_token"] > r["lru"]["copies_per_token"] for r in moef_rows)
    lines += ["Reading:",
              f"- MoEfied trace: prefetch adds up to {100 * gain:.1f} points of hit rate (at {best['slots']} slots)"
              + (f" and beats the demand-fetch optimum at {', '.join(map(str, above_optimum))} slots" if above_optimum else "")
              + (", but copies more in total (its wrong guesses): it pays where copies overlap compute, not where the "
                 "host-to-GPU link is the bottleneck." if more_copies else ".")]
    for trace_name, rows in (("tiny random Mixtral", tiny_rows), ("MoEfied trace", moef_rows)):
        worse = [r["slots"] for r in rows if r["pf"]["hit_rate"] < r["lru"]["hit_rate"]]
        if worse:
            lines.append(f"- {trace_name}: at {', '.join(map(str, worse))} slots prefetch lowers the hit rate: its guesses "
                         "evict experts that the next token reuses (consecutive tokens share experts more often than the "
                         "guess is right there).")
    lines += [
              f"- Published for real Mixtral (mixtral-offloading, secondary sources): LRU hit rates ~40-60%, prefetch "
              f"recall > 80%.", "",
              f"(generated by `bench/moe_bench.py` in {elapsed_s:.0f} s on this machine)", ""]
    return "\n".join(lines)


def modeled_report(rows: list[dict], demand_ratio: float, prefetch_ratio: float) -> str:
    lines = [
        "## Modeled: Mixtral-8x7B-shaped expert offloading (modeled, not measured)", "",
        "Nothing here runs Mixtral. Per-unit times are placement's cost model (bytes over bandwidth, flops over rate, "
        "at each preset's peak numbers), LRU hit rates Che's approximation (`placement/expert_cache_model.py`), and "
        "Tandem's plan is `make_plan` (ILP over pinned experts x LRU slots per layer, each miss copied or computed on "
        "the CPU, whichever the model says is faster; attention and output layer placed too). Assumptions: Mixtral-8x7B "
        f"shapes; {BYTES_PER_WEIGHT} bytes per weight everywhere (~3 bits: mixtral-offloading used 2-3-bit HQQ experts "
        f"and 4-bit attention); uniform expert load; {100 * REPEAT_RATE:.0f}% of tokens repeat the previous token's "
        "expert pair; 1024-token context; batch 1 decode.",
        f"mixtral-offloading-like rows keep attention on the GPU plus {SLOTS} LRU slots per layer (its demo's "
        "offload_per_layer = 4) and copy every miss; with prefetch, demand copies become "
        f"{demand_ratio:.2f}x and prefetch copies {prefetch_ratio:.2f}x LRU's copies (measured on the MoEfied-SmolLM2 "
        f"trace at {SLOTS} slots); prefetch copies overlap the layer's GPU compute but share the PCIe link. "
        "Fiddler-like: attention on the GPU, every expert computed on the CPU.", "",
        "| preset | GPU budget | modeled: no cache (copy every expert) | modeled: LRU, no prefetch | modeled: LRU + "
        "prefetch | modeled: Fiddler-like | modeled: llama.cpp-style layer offload | **modeled: Tandem plan** "
        "(pinned + slots per layer) |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['hardware']}` | {r['budget_label']} ({r['budget_gib']:.1f} GiB) | {r['naive_tok_s']:.2f} | "
                     f"{r['no_prefetch_tok_s']:.2f} | {r['full_tok_s']:.2f} | {r['fiddler_tok_s']:.2f} | "
                     f"{r['layer_offload_tok_s']:.2f} | **{r['plan_tok_s']:.2f}** ({r['plan_pinned']:.1f} + "
                     f"{r['plan_slots']:.1f}) |")
    t4, a100 = PUBLISHED["t4"], PUBLISHED["a100"]
    lines += ["", "Published by mixtral-offloading (arXiv 2312.17238; measured by its authors, Mixtral-8x7B, tok/s):", "",
              "| GPU | full algorithm (LRU + prefetch) | without prefetch | without LRU and prefetch | naive offload (accelerate) |",
              "|---|---|---|---|---|",
              f"| T4 (free Colab) | {t4['full']} | {t4['no_prefetch']} | {t4['no_cache']} | {t4['naive']} |",
              f"| A100 | {a100['full']} | {a100['no_prefetch']} | {a100['no_cache']} | {a100['naive']} |", "",
              "(The full-algorithm and no-prefetch figures are per GPU; for the last two columns we only have the "
              "ranges over their four GPUs and put the low end under T4 and the high end under A100.)", "",
              "Reading:", *_modeled_reading(rows),
              "- The model charges every copy at the preset's pinned-copy PCIe bandwidth and every kernel at peak memory "
              "bandwidth, with no launch, dequantization or Python overhead, so its absolute numbers are well above the "
              "published ones; compare the rows with each other.",
              f"- Plans: ILP status {', '.join(sorted({r['solver'] for r in rows}))} (5 s limit per plan).", ""]
    return "\n".join(lines)


def _modeled_reading(rows: list[dict]) -> list[str]:
    lines = []
    if all(r["full_tok_s"] < r["no_prefetch_tok_s"] for r in rows):
        lines.append("- Modeled prefetch does not pay here: per layer, GPU compute is far shorter than one expert copy, "
                     "so there is little to hide copies under, and wrong guesses cost link time. mixtral-offloading "
                     "measured +33% from prefetch on a T4: its per-layer compute (HQQ dequantization, launches) was long "
                     "enough to hide copies behind, which a bandwidth model does not see.")
    holding = [r for r in rows if r["budget_label"].startswith("mixtral")]
    if all(r["plan_tok_s"] >= max(r["no_prefetch_tok_s"], r["full_tok_s"], r["fiddler_tok_s"]) for r in holding):
        lines.append("- With the same GPU holding as mixtral-offloading, Tandem's plan (some experts pinned, the rest "
                     "cached or computed on the CPU, whichever is faster per miss) models at or above every "
                     "mixtral-offloading-like row and the Fiddler-like row.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit-tokens", type=int, default=1500, help="calibration tokens for MoEfication and the prefetch map")
    parser.add_argument("--trace-tokens", type=int, default=2000, help="held-out tokens in the MoEfied trace")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "moe.md"))
    parser.add_argument("--modeled-out", default=str(REPO_ROOT / "bench" / "modeled_moe.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    start = time.perf_counter()
    checked = check_optimum()
    tiny = tiny_mixtral_trace()
    tiny_rows = trace_rows(tiny)
    moef, info = moefication_trace(fit_tokens=args.fit_tokens, trace_tokens=args.trace_tokens)
    moef_rows = trace_rows(moef)
    at_slots = next(r for r in moef_rows if r["slots"] == SLOTS)
    lru_copies = at_slots["lru"]["copies_per_token"]
    demand_ratio = at_slots["pf"]["demand_copies_per_token"] / lru_copies
    prefetch_ratio = at_slots["pf"]["prefetch_copies_per_token"] / lru_copies
    modeled = modeled_rows(demand_ratio, prefetch_ratio, time_limit_s=5.0)
    report = moe_report(tiny, tiny_rows, moef, moef_rows, info, checked, time.perf_counter() - start)
    atomic_write_bytes(args.out, report.encode())
    modeled_text = modeled_report(modeled, demand_ratio, prefetch_ratio)
    atomic_write_bytes(args.modeled_out, modeled_text.encode())
    print(report)
    print(modeled_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
