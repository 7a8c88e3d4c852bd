"""Inputs of the multi-token fused step (``FusedDecodeStep.step_many`` / ``step_batch``): integer
checks, block tables packed and validated for the C call (batch.h), and the token-by-token path
for steps whose single-token call is not the whole-model C step (``LayerOffloadStep``).

Example::

    ids = int_list([5, 9], "token_ids")                        # [5, 9]; 1.5 or "x" -> TandemError
    tables = pack_tables([[3, 1], [0]], [17, 2], 16, 64)      # int32 [2, 2]; row of token i = tables[i, p // 16] * 16 + p % 16
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from tandem.core.errors import TandemError

from tandem.core.kv_cache import KVCache


def int_list(values, what: str) -> list[int]:
    """Python ints from ints / numpy / torch integers; anything else (floats too) is a one-line error."""
    try:
        return [operator.index(v) for v in values]
    except (TypeError, ValueError):
        raise TandemError(f"{what} must be a sequence of integers") from None


def kv_key(keys: torch.Tensor, values: torch.Tensor) -> tuple:
    """What the layers' KV pointers depend on: addresses, shape, strides, dtype."""
    return keys.data_ptr(), values.data_ptr(), tuple(keys.shape), keys.stride(), values.stride(), keys.dtype


def kv_arrays(keys: torch.Tensor, values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A KV cache's or pool's tensors as the numpy arrays the step reads: contiguous CPU float16 or float32."""
    for t in (keys, values):
        if t.device.type != "cpu" or t.dtype not in (torch.float16, torch.float32) or not t.is_contiguous():
            raise TandemError(f"the fused step reads a contiguous float16 or float32 CPU KV cache, not {t.dtype} "
                              f"on {t.device.type}")
    return keys.detach().numpy(), values.detach().numpy()


def pack_tables(tables, positions: list[int], block_tokens: int, pool_rows: int) -> np.ndarray:
    """int32 [T, width] block tables (zero-padded) after checking that every position lies inside its
    table, every block it uses inside the pool, and that no two tokens write the same KV row."""
    n = len(positions)
    if block_tokens < 1 or pool_rows % block_tokens:
        raise TandemError(f"the KV pool's {pool_rows} rows are not whole blocks of {block_tokens} tokens")
    table_list = [np.asarray(t, dtype=np.int64).reshape(-1) for t in tables]
    packed = np.zeros((n, max(1, max(t.size for t in table_list))), dtype=np.int32)  # [T, width]
    n_blocks = pool_rows // block_tokens
    for i, (table, pos) in enumerate(zip(table_list, positions)):
        if pos < 0 or pos // block_tokens >= table.size:
            raise TandemError(f"position {pos} is past the sequence's {table.size} KV blocks")
        used = table[: pos // block_tokens + 1]
        if used.min() < 0 or used.max() >= n_blocks:
            raise TandemError(f"block table of token {i} names a block outside the pool ({n_blocks} blocks)")
        packed[i, : table.size] = table
    pos = np.asarray(positions, dtype=np.int64)  # [T]
    written = packed[np.arange(n), pos // block_tokens].astype(np.int64) * block_tokens + pos % block_tokens
    if np.unique(written).size < n:
        raise TandemError("two tokens of one step_batch call write the same KV row (same sequence position twice?)")
    return packed


def step_batch_by_token(step, token_ids, positions, tables: np.ndarray, pool, want) -> torch.Tensor:
    """step_batch through ``step(token, pos, cache)``: each token's sequence gathered into a contiguous
    scratch cache, its new KV row written back to the pool. [sum(want), vocab]"""
    rows, bt = [], int(pool.block_tokens)
    for token, pos, table, wanted in zip(token_ids, positions, tables, want):
        index = torch.from_numpy(table[np.arange(pos + 1) // bt].astype(np.int64) * bt + np.arange(pos + 1) % bt)
        scratch = KVCache(step.cfg, pos + 1, dtype=pool.keys.dtype)
        scratch.keys.copy_(pool.keys.index_select(2, index))  # [L, KV, pos+1, hd]
        scratch.values.copy_(pool.values.index_select(2, index))
        logits = step(token, pos, scratch)
        pool.keys[:, :, int(index[-1])] = scratch.keys[:, :, pos]
        pool.values[:, :, int(index[-1])] = scratch.values[:, :, pos]
        if wanted:
            rows.append(logits)
    return torch.stack(rows) if rows else torch.empty(0, step._desc.vocab)
