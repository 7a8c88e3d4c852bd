"""`make bench`: Tandem vs transformers (float32) vs llama.cpp on the default GGUF, same machine, one run.

Each system runs in its own subprocess (so peak RSS is its own), with a warm-up and N timed
repetitions; the table shows medians. Writes bench/dense.md and reassembles bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
PEER_PYTHON = BENCH_DIR / "peers" / "venv" / "bin" / "python"
PARTS = ["dense.md", "synthetic.md", "long_context.md", "hybrid.md", "fused.md", "kernels.md", "moe.md", "modeled_powerinfer.md", "modeled_moe.md",
         "costfit.md"]


def run_records(cmd: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", "30000")  # as the tandem CLI does (see tandem/cli.py)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    records = [json.loads(line[len("BENCH_JSON "):]) for line in proc.stdout.splitlines()
               if line.startswith("BENCH_JSON ")]
    if not records:
        sys.stderr.write(f"benchmark command failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}\n")
    return records


def run_system(cmd: list[str]) -> dict | None:
    records = run_records(cmd)
    return records[0] if records else None


def machine_line() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores, {platform.system()} {platform.machine()}, Python {platform.python_version()}"


def _sections(text: str) -> list[str]:
    """Split markdown at its level-2 headings (a leading chunk before the first one included)."""
    chunks, current = [], []
    for line in text.splitlines():
        if line.startswith("## ") and current:
            chunks.append("\n".join(current).rstrip())
            current = []
        current.append(line)
    if current:
        chunks.append("\n".join(current).rstrip())
    return chunks


def assemble_results() -> None:
    """Rewrite RESULTS.md with the parts' current text in place of their old sections; sections other
    benchmarks wrote straight into RESULTS.md (serving, speculation, cold start, ...) stay where they are."""
    path = BENCH_DIR / "RESULTS.md"
    header = ["# Benchmark results", "",
              "Every figure below is measured on the machine named in its section unless labelled **modeled**."]
    parts = {part: _sections((BENCH_DIR / part).read_text()) for part in PARTS if (BENCH_DIR / part).is_file()}
    owner = {chunk.splitlines()[0]: part for part, chunks in parts.items() for chunk in chunks}
    old = _sections(path.read_text()) if path.is_file() else []
    body, placed = ["\n".join(header)], set()
    for chunk in old[1:] if old and not old[0].startswith("## ") else old:
        part = owner.get(chunk.splitlines()[0])
        if part is None:
            body.append(chunk)
        elif part not in placed:
            body += parts[part]
            placed.add(part)
    body += [chunk for part, chunks in parts.items() if part not in placed for chunk in chunks]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n\n".join(body) + "\n")
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-hybrid", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from tandem.core.loading.resolve import resolve_model_path
    gguf = str(resolve_model_path("smollm2"))
    common = ["--threads", str(args.threads), "--runs", str(args.runs), "--decode-tokens", str(args.decode_tokens)]
    tandem = [sys.executable, "-m", "bench.systems.tandem_dense", *common]
    records = [run_system(tandem)]
    peers = []
    if not args.skip_transformers:
        peers.append(run_system([sys.executable, "-m", "bench.systems.transformers_fp32", "--gguf", gguf, *common]))
    if PEER_PYTHON.is_file():
        peers.append(run_system([str(PEER_PYTHON), str(BENCH_DIR / "systems" / "llamacpp.py"), "--gguf", gguf, *common]))
    peers = [r for r in peers if r]
    records = [r for r in records if r] + peers
    write_dense_table(records, args)
    if not args.skip_hybrid:
        from bench.hybrid_report import run_hybrid
        run_hybrid(args, tandem, peers, run_system, run_records)
        subprocess.run([sys.executable, "-m", "bench.fused_sweep", "--threads", str(args.threads)], cwd=REPO, check=False)
    assemble_results()
    print((BENCH_DIR / "RESULTS.md").read_text())


def write_dense_table(records: list[dict], args) -> None:
    lines = ["## Dense runtime: SmolLM2-135M-Instruct Q4_1 GGUF, batch 1, greedy",
             "",
             f"- Date: {dt.date.today().isoformat()}; machine: {machine_line()}; threads: {args.threads}",
             f"- Command: `make bench` (`python -m bench.run --threads {args.threads} --runs {args.runs} "
             f"--decode-tokens {args.decode_tokens}`); each system in its own process, 1 warm-up + "
             f"{args.runs} timed runs, medians shown (min-max in brackets). The machine is noisy (±15-20%).",
             "",
             "| system | decode tok/s | prefill tok/s | prompt tokens | peak RSS MB |",
             "|---|---|---|---|---|"]
    for r in records:
        dec, pre = r["decode_tok_s"], r["prefill_tok_s"]
        lines.append(f"| {r['system']} | {statistics.median(dec):.1f} [{min(dec):.1f}-{max(dec):.1f}] | "
                     f"{statistics.median(pre):.1f} [{min(pre):.1f}-{max(pre):.1f}] | {r['prompt_tokens']} | "
                     f"{r['peak_rss_mb']:.0f} |")
    ours = next((r for r in records if r["system"].startswith("tandem")), None)
    if ours:
        med = statistics.median(ours["decode_tok_s"])
        gb = ours["weight_bytes_per_token"] / 1e9
        lines += ["", f"Tandem dense reads {gb * 1e3:.0f} MB of weights per decoded token (float32), i.e. "
                      f"{gb * med:.1f} GB/s at the median decode rate."]
        for peer in records:
            if peer is not ours:
                ratio = med / statistics.median(peer["decode_tok_s"])
                lines.append(f"- decode vs {peer['system']}: {ratio:.2f}x")
    if not PEER_PYTHON.is_file():
        lines += ["", "llama.cpp was not measured in this run (`make bench-peers` builds it)."]
    (BENCH_DIR / "dense.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
