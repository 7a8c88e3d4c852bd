"""One memory arena for the weight copies the fused step owns, backed by 2 MiB pages where the kernel gives them.

The step reads its own copies of many matrices (eight rows interleaved, structs.interleave; a predictor
layer's gate and up rows paired, structs.pair_rows). Separate numpy allocations of 0.5-3 MB sit on 4 KiB
pages: a gathered row then costs a TLB miss (with a nested page walk under a hypervisor), and the
predicted rows of a sparse FFN are scattered across the matrix. Measured on this repo's 2-core EPYC VM
(random 10% of 576-byte rows, two threads): 6.5 GB/s on 4 KiB pages, 8-9 GB/s on 2 MiB pages. The arena
maps private anonymous memory in chunks aligned to 2 MiB, asks for transparent huge pages
(``MADV_HUGEPAGE``; a hint: with THP off the arena is plain memory) and hands out 64-byte-aligned
arrays; they stay valid while the arena object lives (keep it with the descriptors that point into it).

Example::

    arena = WeightArena()
    data = arena.empty((rows, row_bytes), np.uint8)   # a view into a huge-page chunk
"""
from __future__ import annotations

import numpy as np

from tandem.core.errors import TandemError
from tandem.core.huge_pages import HUGE_PAGE_BYTES, huge_page_buffer

CHUNK_BYTES = 64 * 2**20  # per mapping; a larger request gets a mapping of its own size
ALIGN_BYTES = 64


class WeightArena:
    """Bump allocator over huge-page-backed chunks (``chunk_bytes`` each, rounded up to 2 MiB)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise TandemError(f"arena chunk size must be positive, got {chunk_bytes}")
        self.chunk_bytes = -(-chunk_bytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        self._maps: list = []  # one array per mapping (each keeps its mmap alive); allocate hands out views of them
        self._free: np.ndarray | None = None  # [n] uint8: the current chunk's unused aligned tail
        self.used_bytes = 0
        self.mapped_bytes = 0

    def can_allocate(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit in the current chunk without mapping another."""
        return self._free is not None and _padded(nbytes) <= self._free.size

    def allocate(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes (uint8, 64-byte aligned, uninitialised)."""
        if nbytes < 0:
            raise TandemError(f"cannot allocate {nbytes} bytes")
        if not self.can_allocate(nbytes):
            self._free = self._map(max(self.chunk_bytes, _padded(nbytes)))
        out, self._free = self._free[:nbytes], self._free[_padded(nbytes):]
        self.used_bytes += nbytes
        return out

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous array in the arena."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.allocate(n).view(dtype).reshape(shape)

    def copy(self, a: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of ``a`` in the arena."""
        out = self.empty(a.shape, a.dtype)
        out[...] = a
        return out

    def _map(self, nbytes: int) -> np.ndarray:
        out = huge_page_buffer(-(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)  # whole huge pages
        self._maps.append(out)
        self.mapped_bytes += out.size + HUGE_PAGE_BYTES
        return out


def _padded(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGN_BYTES) * ALIGN_BYTES
