"""The C decode step's calls over one model descriptor, shared by the two Python steps that drive it:
FusedDecodeStep (online/execution/fused_decode.py: torch tensors, packed from a live model) and
NativeStep (online/execution/native_step.py: numpy arrays mapped from the step cache, no torch).

It owns what a call needs besides the weights: the layers' KV pointers, the single-token scratch
(sized for the bound cache's capacity) and the multi-token scratch (sized per call), and it builds
the ``TdmBatch`` of a multi-token call. Inputs are checked by the callers; this module only calls C.

Example::

    calls = StepCalls(desc, layers, load_native())
    calls.bind(keys, values, capacity_tokens=256)          # float16 (or float32) [L, KV, C, hd] each
    active = calls.decode(token_id, pos, logits_address)    # one token; returns active FFN rows
    active = calls.decode_batches([5, 9], [0, 1], np.zeros((2, 1), np.int32), 256, 256, [False, True], logits_address)
"""
from __future__ import annotations

import ctypes

import numpy as np

from .structs import TdmBatch, addr

SCRATCH_ALIGN_BYTES = 64
KV_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))  # the KV caches the step reads (attention.h)
MAX_BATCH_TOKENS = 64  # tokens per tdm_decode_batch call (longer runs are split, in order)


class StepCalls:
    """``desc``: the TdmModel; ``layers``: its ctypes TdmLayer array; ``native``: the loaded library."""

    def __init__(self, desc, layers, native) -> None:
        self.desc, self.layers, self.native = desc, layers, native
        self._work: np.ndarray | None = None  # the single-token step's scratch
        self._batch_work: np.ndarray | None = None  # the multi-token step's scratch (batch.h)

    def point_layers(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Layer i reads and writes keys[i] / values[i] ([KV, rows, hd], C-contiguous, both float16 or both
        float32: KV_DTYPES)."""
        if keys.dtype != values.dtype or keys.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache of {keys.dtype} keys and {values.dtype} values: the step reads float16 or float32")
        self.desc.kv_half = int(keys.dtype == np.float16)
        for i in range(self.desc.n_layers):
            self.layers[i].k_cache = addr(keys[i])
            self.layers[i].v_cache = addr(values[i])

    def bind(self, keys: np.ndarray, values: np.ndarray, capacity_tokens: int) -> None:
        """Point the layers at one sequence's cache and size the single-token scratch for it."""
        self.point_layers(keys, values)
        self.desc.capacity = int(capacity_tokens)
        n_bytes = int(self.native.lib.tdm_work_bytes(ctypes.byref(self.desc)))
        self._work = _scratch(self._work, n_bytes)
        self.desc.work = _aligned(self._work)

    def decode(self, token_id: int, pos: int, logits_address: int) -> int:
        """One token through every layer (``tdm_decode``); logits [vocab] float32 at the address."""
        return int(self.native.lib.tdm_decode(ctypes.byref(self.desc), int(token_id), int(pos), logits_address))

    def decode_batches(self, token_ids, positions, tables: np.ndarray, block_tokens: int, kv_rows: int, want,
                       logits_address: int | None) -> int:
        """Any number of tokens in ``tdm_decode_batch`` calls of at most MAX_BATCH_TOKENS, in order; the
        wanted tokens' logits rows [vocab] float32 follow one another from the address. Returns the
        active FFN rows summed over the calls."""
        row_bytes = 4 * int(self.desc.vocab)
        active = done = 0
        for a in range(0, len(token_ids), MAX_BATCH_TOKENS):
            b = min(a + MAX_BATCH_TOKENS, len(token_ids))
            wanted = sum(bool(w) for w in want[a:b])
            address = logits_address + done * row_bytes if logits_address is not None and wanted else None
            active += self._decode_batch(token_ids[a:b], positions[a:b], tables[a:b], block_tokens, kv_rows,
                                         want[a:b], address)
            done += wanted
        return active

    def _decode_batch(self, token_ids, positions, tables: np.ndarray, block_tokens: int, kv_rows: int, want,
                      logits_address: int | None) -> int:
        """At most MAX_BATCH_TOKENS tokens in one ``tdm_decode_batch`` call (batch.h); ``tables`` [n, width]
        int32 block ids per token, ``want[i]``: whether token i's logits are written (in order, at the address)."""
        n = len(token_ids)
        span = max(int(p) for p in positions) + 1
        n_bytes = int(self.native.lib.tdm_batch_work_bytes(ctypes.byref(self.desc), n, span))
        self._batch_work = _scratch(self._batch_work, n_bytes)
        tokens = np.asarray(token_ids, dtype=np.int64)  # [n]
        pos = np.asarray(positions, dtype=np.int64)  # [n]
        tables = np.ascontiguousarray(tables, dtype=np.int32)  # [n, width]
        wanted = np.asarray(want, dtype=np.uint8)  # [n]
        batch = TdmBatch(n_tokens=n, tokens=addr(tokens), pos=addr(pos), tables=addr(tables),
                         table_stride=tables.shape[1], block_tokens=int(block_tokens), kv_rows=int(kv_rows),
                         span=span, want=addr(wanted), logits=logits_address)
        single_work = self.desc.work
        self.desc.work = _aligned(self._batch_work)
        try:
            return int(self.native.lib.tdm_decode_batch(ctypes.byref(self.desc), ctypes.byref(batch)))
        finally:
            self.desc.work = single_work  # the single-token step keeps its own scratch


def _scratch(buffer: np.ndarray | None, n_bytes: int) -> np.ndarray:
    if buffer is None or buffer.nbytes < n_bytes + SCRATCH_ALIGN_BYTES:
        return np.zeros(n_bytes + SCRATCH_ALIGN_BYTES, dtype=np.uint8)
    return buffer


def _aligned(buffer: np.ndarray) -> int:
    return (buffer.ctypes.data + SCRATCH_ALIGN_BYTES - 1) & ~(SCRATCH_ALIGN_BYTES - 1)
