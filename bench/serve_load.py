"""Serving load benchmark: concurrent streaming chat clients against `tandem serve` and, side by side in
the same run, llama-cpp-python's OpenAI server on the same GGUF (skipped when bench/peers/venv lacks it).

Per system and client count: aggregate decode tokens/s (all streamed tokens / wall time of the load),
TTFT p50/p95 (request sent -> first content chunk), inter-token latency p50/p95 (gaps between content
chunks of one stream). Medians over ``--repeats`` runs. Goals (issue 16): aggregate tok/s with 8 clients
>= 4x one client's; p95 inter-token latency with 8 clients <= 2.5x one client's.

Example::

    .venv/bin/python -m bench.serve_load --model smollm2 --plan profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0 \\
        --clients 1 8 --requests-per-client 2 --max-tokens 128 --repeats 3 --out bench/serve_load.md
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import tempfile
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.prompt import BENCH_PROMPT

REPO = Path(__file__).resolve().parents[1]
PEER_PYTHON = REPO / "bench" / "peers" / "venv" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# OpenMP barrier waits of the tandem server: "cli" leaves the CLI's own setting (a 30,000-spin barrier, then sleep:
# tandem/cli.py), what `tandem serve` runs with; "passive" sleeps at every barrier (this benchmark's setting for
# every server before the seventeenth session). The peer server runs with its own default from then on (it was
# passive too before): each system as its users run it.
WAIT_POLICIES = {"cli": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def start(cmd: list[str], url: str, timeout_s: float = 300.0, env_extra: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update({"PYTHONPATH": str(REPO), **(env_extra or {})})
    log = tempfile.TemporaryFile(mode="w+")  # not a pipe: llama.cpp's server logs more than a pipe buffers and would block
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited: {' '.join(cmd)}\n{log.read()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start in {timeout_s:.0f} s: {' '.join(cmd)}")


def stream_chat(url: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    """One streaming chat request: TTFT, the gaps between content chunks, the tokens streamed."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, **extra}
    sent = time.perf_counter()
    stamps = []
    with httpx.Client(timeout=600) as http, http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            choices = payload.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("no content streamed")
    return {"ttft_s": stamps[0] - sent, "gaps_s": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": len(stamps)}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def run_load(url: str, n_clients: int, requests_per_client: int, max_tokens: int, extra: dict) -> dict:
    results, errors = [], []

    def client(i: int) -> None:
        for j in range(requests_per_client):
            prompt = f"Reader {i * requests_per_client + j} asks: " + BENCH_PROMPT[:400]
            try:
                results.append(stream_chat(url, prompt, max_tokens, extra))
            except Exception as exc:  # reported, never hidden
                errors.append(str(exc))
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    start_s = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - start_s
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    gaps = [g for r in results for g in r["gaps_s"]]
    ttfts = [r["ttft_s"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"agg_tok_s": tokens / wall_s, "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95),
            "itl_p50": percentile(gaps, 0.5), "itl_p95": percentile(gaps, 0.95), "tokens": tokens, "wall_s": wall_s}


def systems(args) -> list[tuple[str, list[str], dict, int, dict]]:
    out = []
    for prefill, kv, wait in ((p, k, w) for p in args.prefill for k in args.kv_cache_types for w in args.wait_policies):
        port = free_port()
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", args.model, "--threads", str(args.threads),
               "--port", str(port), "--log-level", "warning", "--max-batch", str(max(args.clients)),
               "--prefill-chunk-tokens", str(args.prefill_chunk_tokens), "--prefill", prefill, "--kv-cache-type", kv]
        if args.plan:
            cmd += ["--plan", args.plan]
        if args.weight_format:
            cmd += ["--weight-format", args.weight_format]
        label = "plan" if args.plan else args.weight_format or "dense"
        kv_label = f", {kv} KV" if len(args.kv_cache_types) > 1 else ""
        wait_label = f", {wait} barrier waits" if len(args.wait_policies) > 1 else ""
        out.append((f"tandem ({label}, prefill {prefill}{kv_label}{wait_label})", cmd, {"ignore_eos": True}, port,
                    WAIT_POLICIES[wait]))
    if args.peer and PEER_PYTHON.exists():
        check = subprocess.run([str(PEER_PYTHON), "-c", "import llama_cpp.server.app, uvicorn"], capture_output=True)
        if check.returncode == 0:
            port = free_port()
            gguf = args.gguf or str(resolve_gguf(args.model))
            out.append(("llama-cpp-python server", [str(PEER_PYTHON), "-m", "llama_cpp.server", "--model", gguf,
                                                    "--n_threads", str(args.threads), "--n_ctx", "4096",
                                                    "--port", str(port), "--host", "127.0.0.1",
                                                    "--interrupt_requests", "False"], {}, port, {}))  # queue, not cancel
        else:
            print("peer skipped: bench/peers/venv has no llama_cpp.server (run bench/build_peers.sh)", file=sys.stderr)
    elif args.peer:
        print("peer skipped: bench/peers/venv absent (run bench/build_peers.sh)", file=sys.stderr)
    return out


def resolve_gguf(model: str) -> Path:
    from tandem.core.loading.resolve import resolve_model_path
    return resolve_model_path(model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--gguf", default=None, help="GGUF for the peer (default: the model alias's file)")
    p.add_argument("--plan", default=None, help="tandem plan (the goals use the cpu-only plan)")
    p.add_argument("--weight-format", default=None, choices=("int8", "int4"), help="tandem without a plan")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128,
                   help="tokens per request (default 128, as make bench): with short generations the prefill "
                        "steps of arriving requests are a larger share of the inter-token gaps")
    p.add_argument("--prefill-chunk-tokens", type=int, default=128)
    p.add_argument("--prefill", nargs="+", default=["modules", "step"], choices=("modules", "step"),
                   help="tandem prefill modes to run side by side (serve --prefill)")
    p.add_argument("--kv-cache-types", nargs="+", default=["f16"], choices=("f16", "f32"),
                   help="tandem KV cache types to run side by side (serve --kv-cache-type)")
    p.add_argument("--wait-policies", nargs="+", default=["cli"], choices=tuple(WAIT_POLICIES),
                   help="tandem servers' OpenMP barrier waits, side by side: cli (tandem serve's own 30,000-spin "
                        "setting, the default) or passive (sleep at every barrier)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-peer", dest="peer", action="store_false")
    p.add_argument("--out", default=None, help="write the markdown table here too")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    rows = []
    for name, cmd, extra, port, env_extra in systems(args):
        url = f"http://127.0.0.1:{port}"
        proc = start(cmd, url, env_extra=env_extra)
        try:
            extra = {**extra, "model": httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]}
            stream_chat(url, "Warm up.", 8, extra)
            runs = {c: [] for c in args.clients}
            for _ in range(args.repeats):
                for c in args.clients:
                    try:
                        runs[c].append(run_load(url, c, args.requests_per_client, args.max_tokens, extra))
                    except RuntimeError as exc:  # one system's failure does not lose the others' rows
                        print(f"{name}, {c} clients: {exc}", file=sys.stderr)
            for c in args.clients:
                if runs[c]:
                    med = {k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]}
                    rows.append((name, c, med))
        finally:
            proc.terminate()
            proc.wait(30)
    text = render(rows, args, load)
    print(text)
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
    return 0


def render(rows, args, load: float) -> str:
    lines = [f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; threads {args.threads}; load average "
             f"at start {load:.1f}; {args.requests_per_client} requests x {args.max_tokens} tokens per client; "
             f"medians of {args.repeats} runs; plan: {args.plan or 'none'}",
             f"- Command: `python -m bench.serve_load {' '.join(sys.argv[1:])}`", "",
             "| system | clients | aggregate tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms |",
             "|---|---|---|---|---|---|---|"]
    for name, c, m in rows:
        lines.append(f"| {name} | {c} | {m['agg_tok_s']:.1f} | {1e3 * m['ttft_p50']:.0f} | {1e3 * m['ttft_p95']:.0f} "
                     f"| {1e3 * m['itl_p50']:.1f} | {1e3 * m['itl_p95']:.1f} |")
    lines.append("")
    for name in dict.fromkeys(r[0] for r in rows):
        mine = {c: m for n, c, m in rows if n == name}
        lo, hi = min(mine), max(mine)
        if lo != hi:
            lines.append(f"- {name}: aggregate tok/s {hi} clients / {lo}: {mine[hi]['agg_tok_s'] / mine[lo]['agg_tok_s']:.2f}x "
                         f"(goal >= 4x); ITL p95 {hi} / {lo}: {mine[hi]['itl_p95'] / mine[lo]['itl_p95']:.2f}x (goal <= 2.5x)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
