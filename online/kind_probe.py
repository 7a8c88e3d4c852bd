"""The fused step's row kernels timed per packed format and access pattern: the share of the read bandwidth each reaches.

Each format gets a random matrix of ``PROBE_BYTES`` (past the last-level cache) packed as the runtime packs
it (GGUF blocks through weight_from_gguf, re-packed int4 / int8, f16 / int8 down rows) and is read the way
the step reads it (placement.step_reads): ``dense`` (every row dotted, tdm_dot_rows), ``gather`` (10%,
40% and all of the rows, sorted, tdm_dot_rows_idx), ``pair`` (as many rows, as neighbouring pairs: a
predictor layer's paired gate / up copy), ``axpy`` (as many down rows added, tdm_axpy_rows), ``dense_gu`` /
``rows_gu`` (the matrix's two halves as a layer's up and gate, read whole together 32 rows at a time as the step's
dense slice loop reads them) and ``attend`` (AttendPass: the attention kernel over a KV cache of ``PROBE_BYTES``,
float16 or float32, 2,048 positions of as many KV heads as that takes, at 1, 4 and 8 query heads per KV head).
``threads``
OpenMP threads split the rows as the step's do, timed inside one OpenMP region with every thread awake
(tdm_read_pass_timed: the step reads its matrices in a live region; timed from outside, a pass also paid
the workers' wake-up, and gathered / added rows were rated 10-30% slow until 2026-11-28). Before every timed pass a
buffer of ``evict_bytes()`` (the last-level cache's size plus 96 MB) is read, so the pass starts with none of the
matrix in that cache (48 MB against the AMD host's 32 MB L3: passes back to back found up to two thirds of it
there and read "faster than memory", up to 1.6x the read bandwidth; the 96 MB read used until 2026-11-29 left
most of it cached on the Intel VM's 300 MB L3 whenever the host gave this process much of it: passes after it
read at 35-55 GB/s against ~25 from memory). Rates are bytes read / the median pass's
seconds; the share is that over the probe's torch read bandwidth: since 2026-11-29 the median of samples taken
before each format and access's passes (before: one sample ahead of them all), each a median of repeated reads. (Until
2026-11-28 the best pass was taken: over a median bandwidth on a host whose bandwidth drifts, that rated
dense rows ~10-15% fast, and the synthetic table's dense mode 1.3-1.5x.)

Example::

    rates = measure_kind_rates(threads=2, bandwidth=19e9)     # KindRate per (format, access) of DEFAULT_PLAN
    rates, samples = measure_kind_rates_sampled(2, lambda: measure_read_bandwidth("cpu"))  # over the samples' median
"""
from __future__ import annotations

import ctypes
import functools
import statistics
import threading
import time

import numpy as np

from placement.fused_calibration import KindRate
from placement.probe import last_level_cache_bytes
from placement.step_reads import WHOLE_ACCESSES
from tandem.core.errors import TandemError

from .kernels.native import load_native
from .kernels.native.structs import describe, interleave
from .kernels.quantize import quantize, weight_from_gguf
from .step_inventory import kind_name, weight_bytes

PROBE_BYTES = 48 * 2**20
EVICT_MARGIN_BYTES = 96 * 2**20  # read before each timed pass beyond the last-level cache's size
COLS = 2048
NARROW_COLS = 512  # the second width each row kernel is timed at: what a row costs beyond its bytes (KindRate.row_s)
SPARSE_SHARES = (0.1, 0.4, 1.0)  # shares of the rows a gather / axpy pass reads (rates interpolate between)
ATTEND_GROUPS = (8, 4, 1)  # query heads per KV head an attend pass serves (its KindRate fraction: 1 / group)
ATTEND_CONTEXT_TOKENS, ATTEND_HEAD_DIM = 2048, 64  # the pass's cached positions; PROBE_BYTES sets its KV heads
REPEATS = 7
# GGUF block layouts: (weights per block, bytes per block, offsets of the f16 fields) -- ggml-common.h
GGUF_BLOCKS = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q8_0": (32, 34, (0,)), "Q5_0": (32, 22, (0,)),
               "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}
# (name, access) pairs measured by default: every in-place format read dense and gathered, the formats the step
# interleaves eight rows at a time also read whole in place (``rows``: matrices kept for gathered reads) and
# gathered in neighbouring pairs (``pair``: the paired gate / up copy of predictor layers), the
# down-row formats added (re-packed int4 / int8b rows are the q4_1 / q8_0 kinds: the same dot kernels, so only
# their axpy is timed)
INTERLEAVED = ("Q4_0", "Q4_1", "Q8_0")
DEFAULT_PLAN = tuple((q, a) for q in GGUF_BLOCKS for a in ("dense", "gather")) + tuple(
    (q, a) for q in INTERLEAVED for a in ("rows", "pair", "dense_gu", "rows_gu")) + (
    ("int8", "dense"), ("fp32", "dense")) + tuple((f, "axpy") for f in ("fp16", "int8", "int8b", "int4")) + (
    ("fp16", "attend"), ("fp32", "attend"))
# the probe format that packs each step kind (placement.step_reads names), per access: a down row kind is
# re-packed from float as the runtime packs sparse down rows (int4 -> q4_1 rows, int8b -> q8_0 rows)
PROBE_FORMAT = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0", "q5_0": "Q5_0", "q4_k": "Q4_K", "q5_k": "Q5_K",
                "q6_k": "Q6_K", "int8": "int8", "f32": "fp32", "f16": "fp16", "int8b": "int8b", "int4": "int4"}
AXPY_FORMAT = {"q4_1": "int4", "q8_0": "int8b", "f16": "fp16", "int8": "int8", "f32": "fp32"}


def plan_for(reads) -> tuple[tuple[str, str], ...]:
    """The (probe format, access) pairs that time the given (kind, access) reads."""
    out = []
    for kind, access in reads:
        fmt = (AXPY_FORMAT if access == "axpy" else PROBE_FORMAT).get(kind)
        if fmt is None:
            raise TandemError(f"the probe cannot time {kind} ({access}) reads")
        if (fmt, access) not in out:
            out.append((fmt, access))
    return tuple(out)


def random_gguf(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks [rows, row bytes] with small finite f16 scales (no NaN / subnormal timing effects)."""
    per, nbytes, f16 = GGUF_BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // per, nbytes), dtype=np.uint8)
    for k, off in enumerate(f16):
        blocks[:, off:off + 2] = np.full(blocks.shape[0], 0.01 / (1 + k), np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@functools.lru_cache(maxsize=None)
def cached_weight(fmt: str, axpy: bool, cols: int | None = None):
    """probe_weight, packed once per process (a bench's rounds reuse it)."""
    rng = np.random.default_rng(sorted(PROBE_FORMAT.values()).index(fmt))
    return probe_weight(fmt, "axpy" if axpy else "dense", rng, cols)


def probe_weight(fmt: str, access: str, rng: np.random.Generator, cols: int | None = None):
    """(packed weight, its descriptor ref) of about PROBE_BYTES in format ``fmt`` (a GGUF type or a re-pack),
    rows of ``cols`` weights (None: COLS)."""
    cols = COLS if cols is None else cols
    if fmt in GGUF_BLOCKS:
        per, nbytes, _ = GGUF_BLOCKS[fmt]
        rows = max(64, PROBE_BYTES // (cols // per * nbytes))
        w = weight_from_gguf(random_gguf(fmt, rows, cols, rng), fmt, (rows, cols))
    else:
        per_row = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int8b": 34 / 32, "int4": 0.625}[fmt] * cols
        rows = int(PROBE_BYTES // per_row)
        w = quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.05, fmt)
    return w, describe(w, dot_input=access != "axpy")


def _parallel(threads: int, work) -> float:
    """Seconds for ``work(t, n_threads)`` run on ``threads`` Python threads at once."""
    pool = [threading.Thread(target=work, args=(t, threads)) for t in range(threads)]
    t0 = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return time.perf_counter() - t0


def _pairs(neurons: np.ndarray) -> np.ndarray:
    """Row indices 2r, 2r + 1 for each neuron r (predict.h paired_rows' order)."""
    return np.stack([2 * neurons, 2 * neurons + 1], axis=1).reshape(-1).astype(np.int32)  # [2 n]


class ReadPass:
    """One timed pass of the step's row kernel over a probe matrix (``access``: dense, gather, pair, axpy) on
    OpenMP threads (tdm_read_pass_timed, as the step runs them); calling it reads ``nbytes`` and returns the
    seconds it took. Gathered / added rows change every pass (a repeated pick would come from the last-level
    cache); ``pair`` gathers rows 2r and 2r + 1 of a share of the neurons r, as a predictor layer reads its
    paired gate / up copy (predict.h paired_rows)."""

    def __init__(self, lib, ref, access: str, threads: int, rng: np.random.Generator, picks: int = REPEATS + 1,
                 share: float = 1.0):
        d = ref.desc
        self.lib, self.ref, self.access, self.threads, self.calls = lib, ref, access, threads, 0
        rows, cols = d.rows, d.cols
        self.x = rng.standard_normal(cols, dtype=np.float32)
        if access == "dense":
            self.picks = [np.arange(rows, dtype=np.int32)]
        elif access == "gu":  # the first 2n rows as n up rows then n gate rows (n: whole interleave groups)
            self.picks = [np.arange(rows // 2 // 64 * 64 * 2, dtype=np.int32)]
        elif access == "pair":  # rows 2r and 2r + 1 of a share of the neurons r: a paired gate / up matrix
            n = max(1, int(rows // 2 * share))
            self.picks = [_pairs(np.sort(rng.choice(rows // 2, n, replace=False))) for _ in range(picks if n < rows // 2 else 1)]
        else:
            n = max(1, int(rows * share))
            self.picks = [np.sort(rng.choice(rows, n, replace=False)).astype(np.int32) for _ in range(picks if n < rows else 1)]
        self.out = np.zeros((threads, max(rows, cols)), np.float32)
        self.h = rng.standard_normal(len(self.picks[0]), dtype=np.float32)
        self.nbytes = int(len(self.picks[0]) * weight_bytes(d) / rows)
        self.rows_read = len(self.picks[0])  # rows one pass reads (gu: both matrices' rows)
        self.kind = kind_name(d)  # the step inventory's name of the probed format
        self._idx = self.picks[0]
        self._read_pass = _read_pass(lib)  # None for kernels from before it (bench/native_ab.py's baselines)

    def _work(self, t: int, nt: int) -> None:
        d, idx, lib = self.ref.desc, self._idx, self.lib
        lo, hi = len(idx) * t // nt, len(idx) * (t + 1) // nt
        o = self.out[t].ctypes.data
        if self.access in ("dense", "gu"):
            lib.tdm_dot_rows(ctypes.byref(d), lo, hi - lo, self.x.ctypes.data, 2.0, o)
        elif self.access in ("gather", "pair"):
            lib.tdm_dot_rows_idx(ctypes.byref(d), idx[lo:].ctypes.data, hi - lo, self.x.ctypes.data, 2.0, o)
        else:
            lib.tdm_axpy_rows(ctypes.byref(d), idx[lo:].ctypes.data, self.h[lo:].ctypes.data, hi - lo, o)

    def __call__(self) -> float:
        self._idx = self.picks[self.calls % len(self.picks)]
        self.calls += 1
        _evict_buffer().sum()  # the matrix out of the last-level cache, as after a step's other reads
        read_pass, timed = self._read_pass
        if read_pass is None or (not timed and self.access == "gu"):  # an older entry: no two-matrix access
            return _parallel(self.threads, self._work)
        idx, out = self._idx, self.out
        t0 = time.perf_counter()
        n = len(idx) // 2 if self.access == "gu" else len(idx)  # gu: rows per matrix
        seconds = read_pass(ctypes.addressof(self.ref.desc), ACCESS_CODES[self.access], idx.ctypes.data, n,
                            self.x.ctypes.data, self.h.ctypes.data, self.threads, out.ctypes.data, out.shape[1])
        return seconds if timed else time.perf_counter() - t0


ACCESS_CODES = {"dense": 0, "gather": 1, "pair": 1, "axpy": 2, "gu": 3}  # tdm_read_pass_timed (probe.h)


def evict_bytes() -> int:
    """Bytes read before each timed pass: the last-level cache's reported size plus EVICT_MARGIN_BYTES."""
    return last_level_cache_bytes() + EVICT_MARGIN_BYTES


@functools.lru_cache(maxsize=1)
def _evict_buffer():
    """A torch buffer of evict_bytes() (its ``sum`` reads it on torch's threads: 2.5x numpy's one here)."""
    import torch

    return torch.ones(evict_bytes() // 4, dtype=torch.float32)  # [evict_bytes() / 4]


def _read_pass(lib):
    """(entry, timed): the library's tdm_read_pass_timed (its row kernels on OpenMP threads, as the step runs
    them, timed inside the region), else an older library's untimed tdm_read_pass, else (None, False)."""
    for name, timed in (("tdm_read_pass_timed", True), ("tdm_read_pass", False)):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
            fn.restype = ctypes.c_double if timed else None
            return fn, timed
    return None, False


PASS_PAIRS = 15
PASS_BYTES = 2**19  # one pass of measure_pass_cost: a small model's matrix (SmolLM2's gate / up / down: 0.55 MB)


def measure_pass_cost(threads: int, pass_bytes: int = PASS_BYTES) -> float:
    """Seconds each extra pass over a matrix costs beyond its bytes: the probe's dense Q4_1 matrix read as
    consecutive passes of ``pass_bytes`` with a barrier after each, in one OpenMP region as the step reads
    a layer's matrices (tdm_read_passes), against the same rows in one pass: the median over PASS_PAIRS
    back-to-back pairs (each run after an eviction of the last-level cache) of (many - one) / (passes - 1).
    What it holds: each pass restarts every thread's stream (the hardware prefetchers ramp up again) and
    waits at a barrier for the slowest thread; for small matrices that is a large part of the read (~2 us
    against ~30 us for 0.55 MB here). 0.0 where the kernels predate the entry (bench/native_ab.py's baselines).

    Example::

        measure_pass_cost(threads=2)     # ~2e-6: seconds per pass
    """
    if threads < 1:
        raise TandemError(f"threads must be >= 1, got {threads}")
    lib = load_native().lib
    fn = getattr(lib, "tdm_read_passes", None)
    if fn is None:
        return 0.0
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64]
    fn.restype = None
    ref = interleave(cached_weight("Q4_1", False)[1], lib)
    rows = ref.desc.rows
    pass_rows = max(16, pass_bytes * rows // weight_bytes(ref.desc) // 16 * 16)
    n_passes = -(-rows // pass_rows)
    x = np.random.default_rng(0).standard_normal(ref.desc.cols, dtype=np.float32)
    out = np.zeros((threads, rows), np.float32)

    def timed(per_pass: int, passes: int) -> float:
        _evict_buffer().sum()
        t0 = time.perf_counter()
        fn(ctypes.addressof(ref.desc), per_pass, passes, x.ctypes.data, threads, out.ctypes.data, rows)
        return time.perf_counter() - t0

    # interleaved pairs: the host's bandwidth drifts by more than the effect between separate best-ofs
    diffs = [timed(pass_rows, n_passes) - timed(rows, 1) for _ in range(PASS_PAIRS)]
    return max(0.0, statistics.median(diffs) / (n_passes - 1))


def read_pass(lib, fmt: str, access: str, threads: int, rng: np.random.Generator, share: float = 1.0,
              picks: int = REPEATS + 1, cols: int | None = None) -> ReadPass:
    """A pass over probe format ``fmt``'s matrix (rows of ``cols`` weights; None: COLS) read as the step reads
    it for ``access`` (placement.step_reads): ``dense`` over the eight-row interleaved copy the step streams,
    ``rows`` over the same blocks in place (the matrices it keeps row by row for gathered reads), gathered and
    added rows in place."""
    if access == "attend":
        return AttendPass(lib, fmt, threads, rng, group=round(1 / share))
    ref = cached_weight(fmt, access == "axpy", cols)[1]
    if access in ("dense", "dense_gu"):
        ref = interleave(ref, lib)
    kernel = "gu" if access in ("dense_gu", "rows_gu") else "dense" if access in WHOLE_ACCESSES else access
    return ReadPass(lib, ref, kernel, threads, rng, picks=picks, share=share)


class AttendPass:
    """One timed attention pass (tdm_attend_pass_timed, probe.h) of one token over ATTEND_CONTEXT_TOKENS cached
    positions in ``fmt`` (fp16 / fp32) of as many KV heads of ATTEND_HEAD_DIM as fill about PROBE_BYTES (the same
    context for either type, so the two differ only in their element), ``group`` query heads per KV head, on
    ``threads`` OpenMP threads as the step splits its (group, part, head) units; calling it returns the seconds."""

    def __init__(self, lib, fmt: str, threads: int, rng: np.random.Generator, group: int) -> None:
        fn = getattr(lib, "tdm_attend_pass_timed", None)
        if fn is None:
            raise TandemError("these kernels predate the attention probe (tdm_attend_pass_timed)")
        dtype = {"fp16": np.float16, "fp32": np.float32}[fmt]
        hd, size, self.rows = ATTEND_HEAD_DIM, np.dtype(dtype).itemsize, ATTEND_CONTEXT_TOKENS
        self.n_kv = n_kv = max(1, PROBE_BYTES // (2 * self.rows * hd * size))
        self.k = rng.standard_normal((n_kv, self.rows, hd), dtype=np.float32).astype(dtype)  # [KV, rows, hd]
        self.v = rng.standard_normal((n_kv, self.rows, hd), dtype=np.float32).astype(dtype)  # [KV, rows, hd]
        self.q = rng.standard_normal((n_kv * group, hd), dtype=np.float32)  # [H, hd]
        self.out = np.zeros_like(self.q)
        self.scores = np.zeros(threads * min(group, 16) * self.rows, np.float32)
        self.lib, self.threads, self.group, self.half = lib, threads, group, int(size == 2)
        self.kind, self.nbytes = {"fp16": "f16", "fp32": "f32"}[fmt], self.k.nbytes + self.v.nbytes
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 3
        fn.restype = ctypes.c_double

    def __call__(self) -> float:
        _evict_buffer().sum()  # the cache out of the last-level cache, as after a step's weight reads
        seconds = self.lib.tdm_attend_pass_timed(self.k.ctypes.data, self.v.ctypes.data, self.n_kv, self.rows,
                                                 ATTEND_HEAD_DIM, self.group, self.half, self.threads,
                                                 self.q.ctypes.data, self.out.ctypes.data, self.scores.ctypes.data)
        if seconds < 0:
            raise TandemError("the attention probe could not allocate its scratch")
        return seconds


def time_reads(one: ReadPass) -> tuple[int, float]:
    """(bytes read per pass, median seconds of REPEATS passes after a warm-up one: the same statistic as the
    read bandwidth the share divides by, probe.measure_read_bandwidth)."""
    times = [one() for _ in range(REPEATS + 1)]
    return one.nbytes, statistics.median(times[1:])


def measure_kind_rates(threads: int, bandwidth: float, plan=DEFAULT_PLAN, seed: int = 0) -> tuple[KindRate, ...]:
    """One KindRate per (format, access) of ``plan``, its share over ``bandwidth``; names as the step inventory
    names them (measure_kind_rates_sampled, with the bandwidth fixed)."""
    return measure_kind_rates_sampled(threads, lambda: bandwidth, plan, seed)[0]


def measure_kind_rates_sampled(threads: int, sample_bandwidth, plan=DEFAULT_PLAN,
                               seed: int = 0) -> tuple[tuple[KindRate, ...], list[float]]:
    """(one KindRate per (format, access) of ``plan``, the read bandwidths sampled). ``sample_bandwidth()``
    gives the read bandwidth now; it is sampled before each format and access's passes and once after the
    last, and every share is over the samples' median (one sample taken before the passes read 5-15% off
    their median on the Intel VM, and with it every share, which rated every read a run made that much off).
    Each row kernel is timed over rows of COLS and of NARROW_COLS weights: the share is the wide pass's, and
    the two per-row times give what a row costs beyond its bytes (row_cost)."""
    if threads < 1:
        raise TandemError(f"threads must be >= 1, got {threads}")
    lib, rng, timed, samples = load_native().lib, np.random.default_rng(seed), [], []
    by_format: dict[str, list[str]] = {}
    for fmt, access in plan:
        by_format.setdefault(fmt, []).append(access)
    for fmt, accesses in by_format.items():
        for access in accesses:
            samples.append(float(sample_bandwidth()))
            shares = (1.0,) if access in WHOLE_ACCESSES else tuple(1 / g for g in ATTEND_GROUPS) if access == "attend" \
                else SPARSE_SHARES
            for share in shares:
                one = read_pass(lib, fmt, access, threads, rng, share)
                read, seconds = time_reads(one)
                row_s = row_bytes = 0.0
                if access != "attend":
                    narrow = read_pass(lib, fmt, access, threads, rng, share, cols=NARROW_COLS)
                    narrow_read, narrow_seconds = time_reads(narrow)
                    row_bytes = read / one.rows_read
                    row_s = row_cost((row_bytes, seconds / one.rows_read),
                                     (narrow_read / narrow.rows_read, narrow_seconds / narrow.rows_read))
                timed.append((one.kind, access, share, read, seconds, row_s, row_bytes))
    samples.append(float(sample_bandwidth()))
    bandwidth = statistics.median(samples)
    rates = tuple(KindRate(kind=kind, access=access, share=read / seconds / bandwidth, bytes=read, seconds=seconds,
                           fraction=share, row_s=row_s, row_bytes=row_bytes if row_s > 0 else 0.0)
                  for kind, access, share, read, seconds, row_s, row_bytes in timed)
    return rates, samples


def row_cost(wide: tuple[float, float], narrow: tuple[float, float]) -> float:
    """Seconds each row costs beyond its bytes, from (bytes per row, seconds per row) of passes over wide and
    narrow rows of one kernel: per-row seconds = bytes / rate + row_s, solved for row_s; kept between 0 (noise
    that made narrow rows look faster) and 90% of a wide row's time (the bytes' rate stays finite).

    Example::

        row_cost((2052, 77.7e-9), (516, 25.0e-9))   # ~7.3e-9: a row pays ~7 ns beyond its bytes
    """
    (b_wide, t_wide), (b_narrow, t_narrow) = wide, narrow
    if not (b_wide > b_narrow > 0 and t_wide > 0 and t_narrow > 0):
        return 0.0
    per_byte = (t_wide - t_narrow) / (b_wide - b_narrow)
    if per_byte <= 0:  # narrow rows as slow as wide ones per row: the whole time is per row
        return 0.9 * t_wide
    return float(min(max(t_wide - b_wide * per_byte, 0.0), 0.9 * t_wide))
