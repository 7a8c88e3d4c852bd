"""Headline table: Tandem (dense / exact ReLU / predictor-gated) vs llama.cpp on synthetic-weights GGUFs.

For each shape and sparsity: ``tandem synth`` writes the GGUF (synthetic weights, kept in --models-dir),
the README's step-by-step pipeline builds the profile, predictors and a cpu-only plan, then Tandem's
fused step (bench/systems/tandem_synthetic.py) and llama.cpp (bench/systems/llamacpp.py) decode on
the same file, side by side in one run. Writes bench/synthetic.md and reassembles bench/RESULTS.md.

    python -m bench.synthetic --shapes llama-1b llama-350m --sparsities 0.5 0.8 0.9 0.95
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.run import BENCH_DIR, PEER_PYTHON, REPO, assemble_results, machine_line, run_system

HOT_SHARE = 0.8
RECORDS = BENCH_DIR / "synthetic-records.jsonl"  # every row's JSON record, appended by each run (committed)
QUIET_SHARE = 0.9  # rows whose read bandwidth fell below this share of the calibration probe's (the probe runs
# alone) ran under contention and are not modeled from (before 2026-11-29: an absolute 25 GB/s, the AMD host's)


def cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "tandem.cli", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")


def prepare(shape: str, sparsity: float, models_dir: Path, tokenizer: str | None = None,
            quality: bool = True, profile_tokens: int = 2048, predictor_tokens: int = 4096) -> tuple[Path, Path]:
    """The synthetic model (synth's tokenizer from ``tokenizer``, default SmolLM2's), its profile, predictors and
    CPU plan (its quality measured unless ``quality`` is False) under ``models_dir``, each made once; returns
    (GGUF, folder of the rest)."""
    from synth import SynthSpec, get_shape
    from synth.activity import max_hot_share
    from synth.build import default_file_name

    share = min(HOT_SHARE, round(max_hot_share(sparsity, 0.26) - 0.05, 2))
    spec = SynthSpec(get_shape(shape), sparsity=sparsity, hot_share=share)
    gguf = models_dir / default_file_name(spec)
    work = models_dir / gguf.stem
    if not gguf.exists():
        cli("synth", "--shape", shape, "--out", str(models_dir), "--sparsity", str(sparsity), "--hot-share", str(share),
            "--quiet", *(["--tokenizer-from", str(tokenizer)] if tokenizer else []))
    steps = [("profile", ["profile", "--model", str(gguf), "--tokens", str(profile_tokens), "--no-progress", "--out",
                          str(work / "profile")]),
             ("predictors", ["train-predictors", "--model", str(gguf), "--profile", str(work / "profile"), "--out",
                             str(work / "predictors"), "--no-progress", "--tokens", str(predictor_tokens),
                             "--eval-tokens", str(predictor_tokens // 4)]),
             ("plan", ["plan", "--model", str(gguf), "--profile", str(work / "profile"), "--predictors",
                       str(work / "predictors"), "--hardware", "cpu-only", "--out", str(work / "plan"),
                       *([] if quality else ["--no-quality"])])]
    for folder, args in steps:
        if not (work / folder).exists():
            cli(*args)
    return gguf, work


def predictor_quality(work: Path) -> dict:
    meta = json.loads((work / "predictors" / "predictors.json").read_text())
    used = [layer for layer in meta["layers"] if layer.get("mode") == "predictor"]
    if not used:
        return {"layers": 0}
    mean = lambda k: statistics.mean(layer[k] for layer in used)  # noqa: E731
    return {"layers": len(used), "recall": mean("recall"), "precision": mean("precision"), "rank": mean("rank"),
            "predicted_active": 1 - mean("predicted_sparsity")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-350m"])
    ap.add_argument("--sparsities", nargs="+", type=float, default=[0.5, 0.8, 0.9, 0.95])
    ap.add_argument("--models-dir", default=str(BENCH_DIR / "synthetic-models"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--probe-each-row", action="store_true",
                    help="a fresh `tandem probe --fused` right before each row, its model priced on that calibration "
                         "(the host drifts within minutes; default: one calibration for the whole table)")
    ap.add_argument("--from-log", nargs="+", help="re-render the table from the JSON lines previous runs printed "
                    f"(each run also appends them to {RECORDS.relative_to(REPO)})")
    args = ap.parse_args()
    models_dir = Path(args.models_dir)
    calibration = models_dir / f"fused-calibration-{args.threads}t.json"
    if args.from_log:
        latest = {}  # (shape, sparsity) -> the last run's record (a re-timed row replaces the earlier one)
        for log in args.from_log:
            for line in Path(log).read_text().splitlines():
                if line.startswith('{"shape"'):
                    r = json.loads(line)
                    latest[(r["shape"], r["sparsity"])] = r
        rows = [(r["shape"], r["sparsity"], Path(r["gguf"]), r["tandem"], r["llama.cpp"],
                 predictor_quality(models_dir / Path(r["gguf"]).stem)) for r in latest.values()]
        write_table(rows, args, calibration)
        return
    models_dir.mkdir(parents=True, exist_ok=True)
    timing = ["--threads", str(args.threads), "--runs", str(args.runs), "--decode-tokens", str(args.decode_tokens)]
    if not calibration.exists():
        cli("probe", "--threads", str(args.threads), "--fused", str(calibration))
    rows = []
    for shape in args.shapes:
        for sparsity in args.sparsities:
            gguf, work = prepare(shape, sparsity, models_dir)
            row_calibration = calibration
            if args.probe_each_row:  # kept beside the model's folder: the row's record names it
                row_calibration = work / f"fused-calibration-{args.threads}t.json"
                cli("probe", "--threads", str(args.threads), "--fused", str(row_calibration))
            tandem = run_system([sys.executable, "bench/systems/tandem_synthetic.py", "--gguf", str(gguf), "--plan",
                                 str(work / "plan"), "--predictors", str(work / "predictors"),
                                 "--calibration", str(row_calibration), *timing])
            peer = run_system([str(PEER_PYTHON), "bench/systems/llamacpp.py", "--gguf", str(gguf), *timing]) \
                if PEER_PYTHON.exists() else None
            rows.append((shape, sparsity, gguf, tandem, peer, predictor_quality(work)))
            record = json.dumps({"shape": shape, "sparsity": sparsity, "gguf": str(gguf), "tandem": tandem,
                                 "llama.cpp": peer, "calibration": str(row_calibration)})
            print(record, flush=True)
            with RECORDS.open("a") as f:  # kept: the table can be re-rendered from them (--from-log)
                f.write(record + "\n")
    write_table(rows, args, calibration)


def write_table(rows, args, calibration: Path) -> None:
    rows = sorted(rows, key=lambda r: (r[0], r[1]))
    lines = ["## Synthetic-weights models: sparse Tandem vs llama.cpp (synthetic weights, measured)", "",
             f"- Date: {dt.date.today().isoformat()}; machine: {machine_line()}; threads: {args.threads}; command: "
             f"`python -m bench.synthetic --shapes {' '.join(args.shapes)} --sparsities "
             f"{' '.join(str(s) for s in args.sparsities)}`; decode tok/s = median of {runs_of(rows, args.runs)} "
             "runs of "
             f"{args.decode_tokens} greedy tokens after a 64-token prompt, every system on the same GGUF in one run.",
             "- **Synthetic weights**: random ReLU-sparse models of the named shape from `tandem synth` (not trained; "
             "the text they produce is meaningless). llama.cpp computes the file's FFN as SiLU-gated; inactive gates "
             "are strongly negative so SiLU ~= ReLU (the output gap is measured by `tandem synth`).",
             "- Tandem modes, all through the fused C step: *dense* reads every FFN row; *exact* computes every gate "
             "row and only the up/down rows of active neurons (exact ReLU zeros); *predictor* runs the layer's "
             "low-rank predictor (int8; closed-form reduced-rank gate or trained scorer, whichever `train-predictors` kept) and reads only the predicted gate/up rows and active down rows.",
             "- bytes/token: weight bytes each mode reads per token (attention, output layer, FFN rows, predictor), "
             "and the KV cache (float16, the default) every mode reads at the run's mean context (placement.step_reads.kv_read_bytes); "
             "limit: weight + KV bytes per token against the read bandwidth measured in the same process (after "
             "the slash: weights only, the table's limit before 2026-11-28); achieved = tok/s / limit. Since "
             "2026-11-29 the bandwidth is the median over the mode's runs of the mean of samples right before and "
             "right after each "
             "run, and the three modes are timed round by round (2026-11-28: samples before each run, the modes one "
             "after another; before: one snapshot per process).",
             "- modeled: `tandem probe --fused`'s terms (fixed cost per call and per layer from tiny random Llama "
             "models; the row kernels' rate per packed format and access: dense rows, gathered rows, added down rows) "
             "applied to each mode's reads by format and access (the step's own packed tensors at the rows the run "
             "counted; placement.step_reads), at the read bandwidth sampled beside the mode's runs (the probe's "
             "shares and fixed costs are the model; the host's bandwidth, which drifts by a third within minutes "
             "here, is its input, as it is the limit's); in brackets modeled / measured (goal: 0.75-1.25): since "
             "2026-11-29 the median over runs of each run's modeled / measured, the model at that run's own "
             "bandwidth (before: the medians' ratio). The same model at the probe's own bandwidth is summarized "
             "under the table.",
             "- read GB/s: torch-sum read bandwidth measured inside the Tandem process of that row (predictor mode's "
             "median): the 2 cores are "
             "shared with other jobs, and rows where it falls far below ~30 GB/s ran under contention (all "
             "systems of a row share it, so compare within a row).",
             *calibrations_line(rows),
             "",
             "| shape | sparsity (measured) | llama.cpp tok/s | dense tok/s | exact tok/s | predictor tok/s | predictor / llama.cpp "
             "| predictor recall / precision (rank) | MB/token dense / exact / predictor (+ KV) "
             "| predictor limit tok/s (achieved): weights + KV / weights only "
             "| modeled tok/s dense / exact / predictor (modeled / measured) | read GB/s in the run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, sparsity, gguf, tandem, peer, q in rows:
        if tandem is None:
            lines.append(f"| {shape} | {sparsity:.0%} | failed | | | | | | | | | |")
            continue
        modes = {m["mode"]: m for m in tandem["modes"]}
        ll = statistics.median(peer["decode_tok_s"]) if peer else float("nan")
        d, e, p = modes["dense"], modes["relu-exact"], modes["predictor"]
        pq = (f"{q['recall']:.3f} / {q['precision']:.3f} ({q['rank']:.0f})" if q.get("layers") else "no predictor layers")
        lines.append(
            f"| {shape} | {sparsity:.0%} ({p['sparsity']:.1%}) | {ll:.1f} | {d['decode_tok_s_median']:.1f} | "
            f"{e['decode_tok_s_median']:.1f} | {p['decode_tok_s_median']:.1f} | {p['decode_tok_s_median'] / ll:.2f}x | {pq} | "
            f"{d['bytes_per_token'] / 1e6:.0f} / {e['bytes_per_token'] / 1e6:.0f} / {p['bytes_per_token'] / 1e6:.0f} "
            f"(+ {p.get('kv_bytes_per_token', 0.0) / 1e6:.0f}) | {limits(p)} | "
            + " / ".join(f"{m.get('modeled_tok_s', float('nan')):.1f} ({modeled_over_measured(m):.2f})"
                         for m in (d, e, p))
            + f" | {p['read_bandwidth'] / 1e9:.1f} |")
    lines += probe_bandwidth_line(rows)
    lines += modeled_7b(rows, calibration)
    (BENCH_DIR / "synthetic.md").write_text("\n".join(lines) + "\n")
    assemble_results()
    print("\n".join(lines))



def runs_of(rows, default: int) -> int:
    """The runs per mode the records hold (a --from-log render of older records: theirs, not --runs')."""
    counts = {len(t["modes"][0]["decode_tok_s"]) for *_, t, _, _ in rows if t}
    return counts.pop() if len(counts) == 1 else default


def calibrations_line(rows) -> list[str]:
    """A bullet where the rows were priced on more than one calibration (``--probe-each-row``)."""
    probes = {round(m["calibration_bandwidth"]) for *_, t, _, _ in rows if t for m in t["modes"]
              if "calibration_bandwidth" in m}
    if len(probes) < 2:
        return []
    return [f"- Each row's model is priced on its own `tandem probe --fused`, taken right before the row "
            f"(`--probe-each-row`: {len(probes)} calibrations, the probe's bandwidth "
            f"{min(probes) / 1e9:.1f}-{max(probes) / 1e9:.1f} GB/s)."]


def modeled_over_measured(mode: dict) -> float:
    """The median over runs of modeled / measured, each run against the model at its own bandwidth (records
    from before 2026-11-29: the median modeled over the median measured)."""
    if "modeled_over_measured" in mode:
        return mode["modeled_over_measured"]
    return mode.get("modeled_tok_s", float("nan")) / mode["decode_tok_s_median"]


def probe_bandwidth_line(rows) -> list[str]:
    """The modeled / measured range with the calibration's own probe bandwidth instead of the run's (records
    from before 2026-11-28 carry only one modeled figure: none)."""
    ratios, bandwidths = [], set()
    for _, _, _, tandem, _, _ in rows:
        for m in (tandem or {}).get("modes", []):
            if "modeled_tok_s_probe_bandwidth" in m:
                ratios.append(m["modeled_tok_s_probe_bandwidth"] / m["decode_tok_s_median"])
                bandwidths.add(round(m["calibration_bandwidth"] / 1e9, 1))
    if not ratios:
        return []
    named = ", ".join(f"{b} GB/s" for b in sorted(bandwidths)) if len(bandwidths) < 4 else \
        f"{len(bandwidths)} probes, {min(bandwidths)}-{max(bandwidths)} GB/s"
    return ["", f"At the probe's own bandwidth ({named}) instead of the run's, modeled / measured spans "
                f"{min(ratios):.2f}-{max(ratios):.2f} over the same rows."]


def limits(mode: dict) -> str:
    """'limit (achieved) / weights-only limit (achieved)' of a mode (records from before the KV term: one limit)."""
    tok_s, out = mode["decode_tok_s_median"], []
    for key in ("bytes_limit_tok_s", "weights_limit_tok_s"):
        if key in mode:
            out.append(f"{mode[key]:.1f} ({tok_s / mode[key]:.0%})")
    return " / ".join(out)


def row_bandwidth(tandem: dict, cal) -> float:
    """The read bandwidth of the probe a row was priced on (its own with --probe-each-row), else ``cal``'s."""
    return tandem["modes"][0].get("calibration_bandwidth", cal.read_bandwidth_bytes_per_s)


def modeled_7b(rows, calibration: Path, shapes=("llama-2-7b", "llama-2-13b")) -> list[str]:
    """7B-class rows, **modeled** (no machine here holds them with room to spare, no GPU lent): the
    measured row fractions of the largest quiet measured shape at each sparsity, applied to the big shape's
    bytes, at the fused-step rates of the calibration; llama.cpp at the bandwidth share it reached."""
    from dataclasses import replace

    from placement.fused_calibration import load_calibration
    from synth import get_shape

    if not calibration.exists():
        return []
    cal = load_calibration(calibration)
    q4 = 18 / 32  # Q4_0 bytes per weight, as llama.cpp reads them

    def q4_dense_bytes(shape) -> float:
        d, kv = shape.hidden, shape.n_kv_heads * shape.head_dim
        return (shape.n_layers * (2 * d * d + 2 * d * kv + 3 * d * shape.n_ff) + 49152 * d) * q4

    quiet_rows = [(shape, sparsity, tandem, peer) for shape, sparsity, _, tandem, peer, _ in rows if tandem and peer
                  and tandem["modes"][0]["read_bandwidth"] >= QUIET_SHARE * row_bandwidth(tandem, cal)]
    measured_here = {(shape, sparsity) for shape, sparsity, _, tandem, _, _ in rows if tandem}

    def source(big, sparsity):  # the largest shape smaller than ``big`` measured quietly at that sparsity
        smaller = [r for r in quiet_rows if r[1] == sparsity and q4_dense_bytes(get_shape(r[0])) < q4_dense_bytes(big)]
        return max(smaller, key=lambda r: q4_dense_bytes(get_shape(r[0])), default=None)

    if not quiet_rows:
        return []

    def kv_scale(a, b) -> float:  # KV bytes per token of context (same element type), shape a over shape b
        return (a.n_layers * a.n_kv_heads * a.head_dim) / (b.n_layers * b.n_kv_heads * b.head_dim)

    out = ["", "### 7B-class shapes: **modeled** where the table above has no row (no GPU machine was lent to this run)",
           "", "Each mode's bytes per token measured above on the named smaller shape at the same sparsity, scaled by the "
           "ratio of the two shapes' Q4_0 sizes (same row fractions, same formats), plus the big shape's KV cache at "
           "the same context; time = the fused-step terms of "
           f"`tandem probe --fused` (this machine, {cal.threads} threads); llama.cpp = the big shape's Q4_0 bytes at "
           "the read rate llama.cpp reached on the smaller shape (rows whose read bandwidth fell below "
           f"{QUIET_SHARE:.0%} of their probe's ran under contention and are skipped).", "",
           "| shape | sparsity | from | modeled llama.cpp tok/s | modeled Tandem dense | modeled Tandem exact "
           "| modeled Tandem predictor | predictor / llama.cpp |",
           "|---|---|---|---|---|---|---|---|"]
    for name in shapes:
        big = get_shape(name)
        for sparsity in sorted({r[1] for r in quiet_rows}):
            if (name, sparsity) in measured_here or source(big, sparsity) is None:  # measured above / nothing smaller
                continue
            src, _, tandem, peer = source(big, sparsity)
            modes = {m["mode"]: m for m in tandem["modes"]}
            scale = q4_dense_bytes(big) / q4_dense_bytes(get_shape(src))
            ll = statistics.median(peer["decode_tok_s"]) * q4_dense_bytes(get_shape(src)) / q4_dense_bytes(big)
            kv = modes["dense"].get("kv_bytes_per_token", 0.0) * kv_scale(big, get_shape(src))  # same context
            at = replace(cal, read_bandwidth_bytes_per_s=row_bandwidth(tandem, cal))  # the source row's host state
            rates = [1 / at.step_seconds("int4", big.n_layers, modes[m]["bytes_per_token"] * scale + kv)
                     for m in ("dense", "relu-exact", "predictor")]
            out.append(f"| {name} (modeled) | {sparsity:.0%} | {src} | {ll:.2f} | {rates[0]:.2f} | {rates[1]:.2f} | "
                       f"{rates[2]:.2f} | {rates[2] / ll:.2f}x |")
    return out if out[-1].startswith("| llama") else []  # every big shape measured above, or nothing smaller


if __name__ == "__main__":
    main()
