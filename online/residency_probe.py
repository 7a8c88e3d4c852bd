"""How much faster the step's dense kernel reads a working set it read one pass before: the cache's part in a step.

A decode step reads the same weights every token. Where they fit the part of the last-level cache this
process gets, some of each token's reads come from that cache and not from memory. The probe's rates
(online.kind_probe) are timed after an eviction, so they price every byte at memory speed. On the Intel VM
of 2026-11-29 (300 MB L3 nominal) a SmolLM2 int4 step (97 MB) ran 1.09-1.19x faster right after another step
than after an eviction; smaller working sets gain more (below).

``speedup(W)`` = seconds of a pass over W bytes after an eviction / seconds of the same pass right after
another over them: the probe's dense Q4_1 kernel over the eight-row interleaved copy the step streams, the
median of PAIRS interleaved pairs of each (the host drifts by more than the effect between separate runs).
Measured there (prefixes of one matrix, evicted by a read of the cache's size plus 96 MB: kind_probe): ~2x up
to 16 MB, 1.6-1.8x at 32 MB, 1.2-1.4x at 64 MB, 1.0-1.15x at ~100 MB (once 1.4x), ~1.0x from 128 MB. The cost
model (placement.fused_calibration) divides the reads a step repeats every token (whole matrices, the KV cache)
by the speedup at the step's bytes per token.

Example::

    probe = ResidencyProbe(threads=2, max_bytes=128 * 2**20)   # ~1 s: packs a random Q4_1 matrix
    probe.speedup(97e6)                                        # ~1.0-1.2 here
    measure_residency(threads=2)                               # ((8 MiB, s), ..., (256 MiB, s))
"""
from __future__ import annotations

import ctypes
import statistics

import numpy as np

from tandem.core.errors import TandemError

from .kernels.native import load_native
from .kernels.native.structs import describe, interleave
from .kernels.quantize import weight_from_gguf
from .kind_probe import _evict_buffer, _read_pass, random_gguf

RESIDENCY_SIZES = tuple(mb * 2**20 for mb in (8, 16, 32, 64, 128, 256))  # working sets a calibration measures
PAIRS = 9
COLS = 2048
ROW_BYTES = COLS // 32 * 20  # a Q4_1 row: 20-byte blocks of 32 weights
ROW_ALIGN = 64  # prefixes of whole interleave groups


class ResidencyProbe:
    """A random Q4_1 matrix of ``max_bytes`` (interleaved as the step streams it) whose prefixes are read
    evicted and warm on ``threads`` OpenMP threads (kind_probe's tdm_read_pass_timed, dense access)."""

    def __init__(self, threads: int, max_bytes: int = RESIDENCY_SIZES[-1], seed: int = 0) -> None:
        if threads < 1:
            raise TandemError(f"threads must be >= 1, got {threads}")
        self.lib, self.threads = load_native().lib, threads
        self._pass, timed = _read_pass(self.lib)
        if self._pass is None or not timed:
            raise TandemError("these kernels predate the timed read pass (tdm_read_pass_timed)")
        rng = np.random.default_rng(seed)
        rows = max(ROW_ALIGN, int(max_bytes) // ROW_BYTES // ROW_ALIGN * ROW_ALIGN)
        w = weight_from_gguf(random_gguf("Q4_1", rows, COLS, rng), "Q4_1", (rows, COLS))
        self.ref = interleave(describe(w, dot_input=True), self.lib)
        self.rows = rows
        self.x = rng.standard_normal(COLS, dtype=np.float32)  # [cols]
        self.out = np.zeros((threads, rows), np.float32)  # [threads, rows]
        self.first = np.zeros(1, np.int32)  # dense access reads rows first[0] .. first[0] + n - 1

    @property
    def max_bytes(self) -> int:
        return self.rows * ROW_BYTES

    def _read(self, rows: int) -> float:
        return self._pass(ctypes.addressof(self.ref.desc), 0, self.first.ctypes.data, rows, self.x.ctypes.data,
                          self.x.ctypes.data, self.threads, self.out.ctypes.data, self.rows)

    def speedup(self, working_set_bytes: float, pairs: int = PAIRS) -> float:
        """Evicted pass seconds / warm pass seconds over ``working_set_bytes`` (the matrix's size where larger:
        the speedup only falls with the working set, and is ~1 past the cache, so a step of more bytes than the
        matrix is given the matrix's speedup)."""
        evicted, warm = self.median_pair(working_set_bytes, pairs)
        return evicted / warm

    def median_pair(self, working_set_bytes: float, pairs: int = PAIRS) -> tuple[float, float]:
        """(median evicted seconds, median warm seconds) of ``pairs`` timed_pair calls over ``working_set_bytes``."""
        if pairs < 1:
            raise TandemError(f"pairs must be >= 1, got {pairs!r}")
        times = [self.timed_pair(working_set_bytes) for _ in range(pairs)]
        return statistics.median(e for e, _ in times), statistics.median(w for _, w in times)

    def _rows(self, working_set_bytes: float) -> int:
        if not working_set_bytes > 0:
            raise TandemError(f"working set must be > 0 bytes, got {working_set_bytes!r}")
        return min(self.rows, max(ROW_ALIGN, int(working_set_bytes) // ROW_BYTES // ROW_ALIGN * ROW_ALIGN))

    def pass_bytes(self, working_set_bytes: float) -> int:
        """The bytes one pass over ``working_set_bytes`` reads (whole interleave groups, at most the matrix)."""
        return self._rows(working_set_bytes) * ROW_BYTES

    def timed_pair(self, working_set_bytes: float) -> tuple[float, float]:
        """(seconds of a pass over ``working_set_bytes`` after an eviction, seconds of the next pass but one)."""
        rows = self._rows(working_set_bytes)
        _evict_buffer().sum()
        evicted = self._read(rows)
        self._read(rows)
        return evicted, self._read(rows)


def measure_residency(threads: int, sizes: tuple[int, ...] = RESIDENCY_SIZES,
                      pairs: int = PAIRS) -> tuple[tuple[int, float], ...]:
    """((working set bytes, speedup), ...) at ``sizes`` (~5 s for the default ones, most of it packing), the
    sizes' pairs taken in turn (a burst of contention then slows every size's pair alike)."""
    if not sizes or pairs < 1:
        raise TandemError(f"measure_residency needs sizes and pairs >= 1, got {sizes!r}, {pairs!r}")
    probe = ResidencyProbe(threads, max(sizes))
    times: dict = {s: [] for s in sorted(sizes)}
    for _ in range(pairs):
        for s in times:
            times[s].append(probe.timed_pair(s))
    return tuple((int(s), round(statistics.median(e for e, _ in t) / statistics.median(w for _, w in t), 4))
                 for s, t in times.items())
