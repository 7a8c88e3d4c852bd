"""Shared helpers for benchmark subprocesses: timing records and peak RSS."""
from __future__ import annotations

import json
import resource
import sys


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def emit(record: dict) -> None:
    record["peak_rss_mb"] = round(peak_rss_mb(), 1)
    sys.stdout.write("BENCH_JSON " + json.dumps(record) + "\n")
    sys.stdout.flush()


def timing_arguments(description: str):
    """The flags every benchmark subprocess shares: --threads, --runs, --decode-tokens."""
    import argparse
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=128)
    return ap
