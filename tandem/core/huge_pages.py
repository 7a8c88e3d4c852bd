"""Zeroed arrays on 2 MiB pages (transparent huge pages, where the kernel gives them), for memory the decode
step reads in many scattered runs: weight copies (online/kernels/native/arena.py) and KV caches.

A KV cache is laid out [L, KV, C, hd] (tandem/core/kv_cache.py): one token's keys sit in L x KV runs a layer
apart, so a step over a history touches every run's pages, and a paged pool's blocks (online/kv_pool.py) are
2 KiB runs spread over regions of megabytes. On 4 KiB pages each run is a TLB miss (a nested page walk under a
hypervisor); on 2 MiB pages the runs of one region share an entry. Linux's THP setting is usually ``madvise``
(only memory that asks gets huge pages), so the mapping asks (``MADV_HUGEPAGE``); with THP off or refused it is
plain zeroed memory and the arrays are the same.

Example::

    keys = huge_page_zeros((layers, kv_heads, tokens, head_dim), np.float16)   # numpy, zeroed
    keys_t = torch.from_numpy(keys)                                            # a torch view of it
"""
from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE_BYTES = 2 * 2**20


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` zeroed bytes (uint8) starting on a 2 MiB boundary of a private anonymous mapping that asked for
    huge pages; the array keeps the mapping alive."""
    size = -(-max(int(nbytes), 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    m = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=flags) if flags else mmap.mmap(-1, size + HUGE_PAGE_BYTES)
    buf = np.frombuffer(m, dtype=np.uint8)
    start = (-buf.ctypes.data) % HUGE_PAGE_BYTES  # the first 2 MiB boundary: whole huge pages from there
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE, start, size)
        except OSError:  # THP compiled out or refused: plain pages, same arrays
            pass
    return buf[start:start + nbytes]


def huge_page_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed C-contiguous array of ``shape`` and ``dtype``, on huge pages from 2 MiB up (smaller ones are
    plain ``np.zeros``: one page holds them, and a mapping of their own would round them up to 2 MiB)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n < HUGE_PAGE_BYTES:
        return np.zeros(shape, dtype)
    return huge_page_buffer(n).view(dtype).reshape(shape)


def huge_page_tensor(shape: tuple[int, ...], dtype):
    """A zeroed CPU torch tensor of any torch dtype (bfloat16 too), on huge pages as ``huge_page_zeros``."""
    import torch
    n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if n < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(huge_page_buffer(n)).view(dtype).reshape(shape)
