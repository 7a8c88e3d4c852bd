"""Host -> GPU-tier copies that overlap compute: a CUDA copy stream, or one background thread.

Every copy into a cache slot goes through a copier, in submission order, and returns a handle;
compute on a slot first calls ``wait(handle)``; after compute on a slot, ``mark_read(slot_key)``
lets a later copy into that slot wait until the reads are done (CUDA: an event on the compute
stream; on the CPU tier compute is synchronous, so nothing is needed).

Example::

    copier = make_copier(tier)                 # CudaCopier on CUDA, ThreadCopier otherwise
    handle = copier.copy(slot_key=(3, 0), dst=slot_buffer, src=expert.host)
    copier.wait(handle)                        # before computing on slot_buffer
    copier.mark_read((3, 0))                   # after computing on it
    copier.close()
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Hashable

import torch


class ThreadCopier:
    """Copies on one background thread (torch's copy releases the GIL, so it overlaps compute)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-expert-copy")

    def copy(self, slot_key: Hashable, dst: torch.Tensor, src: torch.Tensor) -> Future:
        return self._pool.submit(dst.copy_, src)

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.result()

    def mark_read(self, slot_key: Hashable) -> None:
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaCopier:
    """Non-blocking copies from pinned host buffers on a dedicated CUDA stream, ordered by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._read_done: dict[Hashable, torch.cuda.Event] = {}

    def copy(self, slot_key: Hashable, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            reads = self._read_done.get(slot_key)
            if reads is not None:
                self.stream.wait_event(reads)  # earlier kernels on this slot must finish reading it
            dst.copy_(src, non_blocking=True)
            done.record(self.stream)
        return done

    def wait(self, handle: Any) -> None:
        if handle is not None:
            torch.cuda.current_stream(self.device).wait_event(handle)

    def mark_read(self, slot_key: Hashable) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._read_done[slot_key] = event

    def close(self) -> None:
        self.stream.synchronize()


def make_copier(tier) -> ThreadCopier | CudaCopier:
    return CudaCopier(tier.device) if tier.is_cuda else ThreadCopier()
