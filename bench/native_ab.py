"""The C decode kernels as they were at a git ref, built beside this checkout's, for A/B runs in one process.

``baseline_library("main")`` copies ``online/kernels/native/*`` at that ref into a temporary folder,
compiles it with the flags ``load_native`` uses (``-march=native`` first) and returns a
``NativeLibrary`` with the same ctypes signatures; a ``FusedDecodeStep`` then runs either library by
swapping its ``native`` attribute (the descriptors and the work buffer are the same structs, as long as
neither side added struct fields). ``interleaved_cpu_ms`` times calls alternately, A/B then B/A, with
this thread's CPU time (threads 1: the step's own work, free of the scheduler's waits on a shared host).

    python -m bench.multi_token --plan profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0 --threads 1 --baseline-ref main
"""
from __future__ import annotations

import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

from online.kernels.native import BASE_FLAGS, HOST_FLAGS, NativeLibrary, _compiler
from online.kernels.native.structs import bind_signatures
from tandem.core.errors import TandemError

NATIVE_DIR = "online/kernels/native"


def baseline_library(ref: str, repo: Path | None = None) -> NativeLibrary:
    """Build the kernels of git ``ref`` (e.g. "main", a commit) into a temporary .so and load it."""
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        names = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", f"{ref}:{NATIVE_DIR}"],
                               capture_output=True, text=True, check=True).stdout.split()
    except subprocess.CalledProcessError as exc:
        raise TandemError(f"cannot read {NATIVE_DIR} at git ref {ref!r}: {exc.stderr.strip()}") from None
    folder = Path(tempfile.mkdtemp(prefix="tandem-ab-"))
    for name in names:
        if name.endswith((".c", ".h")):
            blob = subprocess.run(["git", "-C", str(repo), "show", f"{ref}:{NATIVE_DIR}/{name}"],
                                  capture_output=True, check=True).stdout
            (folder / name).write_bytes(blob)
    out = folder / "baseline.so"
    errors = []
    for flags in (BASE_FLAGS + HOST_FLAGS, BASE_FLAGS):
        proc = subprocess.run([_compiler(), *flags, "-I", str(folder), "-o", str(out), str(folder / "decode.c"), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            lib = ctypes.CDLL(str(out))
            bind_signatures(lib)
            return NativeLibrary.opened(lib, out)
        errors.append((proc.stderr or proc.stdout).strip().splitlines()[:1])
    raise TandemError(f"could not build the kernels of {ref!r}: {errors}")


def interleaved_cpu_ms(step, libs: dict[str, NativeLibrary], fn, rounds: int, clock=time.thread_time) -> dict[str, list[float]]:
    """{name: [ms of fn() per round]} with step.native switched per call, the order flipped every round; ``clock``:
    this thread's CPU time (default) or ``time.perf_counter`` (wall: the other threads' share counts too)."""
    names, out = list(libs), {name: [] for name in libs}
    original = step.native
    try:
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                use_library(step, libs[name])
                c0 = clock()
                fn()
                out[name].append((clock() - c0) * 1e3)
    finally:
        use_library(step, original)
    return out


def use_library(step, native: NativeLibrary) -> None:
    """Route the step's C calls to ``native``: the step's own handle and, where the calls go through a
    StepCalls object (online/kernels/native/step_calls.py, main after 2026-11-23 evening), its handle too."""
    step.native = native
    calls = getattr(step, "_calls", None)
    if calls is not None and hasattr(calls, "native"):
        calls.native = native
    bound = getattr(step, "_bound_cache", None)
    cache = bound() if bound is not None else None
    if cache is not None and hasattr(step, "_bind"):  # the scratch re-sized for this library now (it only grows),
        step._bind(cache)  # not in the next, timed call: the two sides may lay it out differently
