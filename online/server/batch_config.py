"""Settings of the batching server: KV pool budget, prefill budget per step, batch cap, schedule.

Example::

    config = BatchConfig(kv_budget_bytes=parse_bytes("256MiB"), prefill_chunk_tokens=128, schedule="mlfq")
    pool = config.make_pool(engine)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from online.kv_pool import DEFAULT_BLOCK_TOKENS, KVPool, kv_bytes_per_token
from online.server.policy import SCHEDULES
from tandem.core.errors import TandemError, check_int

DEFAULT_KV_BUDGET_BYTES = 256 << 20
DEFAULT_PREFILL_CHUNK_TOKENS = 128
DEFAULT_MAX_BATCH_SEQS = 32
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"256MiB"``, ``"1.5GB"``, ``"1048576"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise TandemError(f"cannot read a byte size from {text!r} (examples: 256MiB, 1GiB, 1048576)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise TandemError(f"a byte size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class BatchConfig:
    kv_budget_bytes: int | None = None  # None: see make_pool
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    max_batch_seqs: int = DEFAULT_MAX_BATCH_SEQS
    schedule: str = "fcfs"
    max_n: int = 16  # choices per request
    prefill: str = "step"  # "step": through step_batch (fused; bench/RESULTS.md: lower TTFT and ITL under load); "modules"
    spec_max_seqs: int = 2  # serve --speculate drafts only while at most this many sequences are in the loop

    def __post_init__(self) -> None:
        for name in ("block_tokens", "prefill_chunk_tokens", "max_batch_seqs", "max_n", "spec_max_seqs"):
            check_int(name, getattr(self, name), 1, optional=False)
        if self.kv_budget_bytes is not None and (isinstance(self.kv_budget_bytes, bool)
                                                 or not isinstance(self.kv_budget_bytes, int)
                                                 or self.kv_budget_bytes < 1):
            raise TandemError(f"kv_budget_bytes must be a positive integer, got {self.kv_budget_bytes!r}")
        if self.prefill_chunk_tokens % self.block_tokens:
            raise TandemError(f"prefill_chunk_tokens ({self.prefill_chunk_tokens}) must be a multiple of the KV "
                              f"block size ({self.block_tokens} tokens)")
        if self.prefill not in ("modules", "step"):
            raise TandemError(f"prefill must be 'modules' or 'step', got {self.prefill!r}")
        if self.schedule not in SCHEDULES:
            raise TandemError(f"unknown schedule {self.schedule!r} (choose from {', '.join(SCHEDULES)})")

    def make_pool(self, engine) -> KVPool:
        """The pool for ``engine``: the budget given, else ``max_batch_seqs`` full contexts capped at
        DEFAULT_KV_BUDGET_BYTES but at least one full context, and never more than a quarter of the
        memory available now (requests that cannot fit are answered 400, never an out-of-memory crash)."""
        import psutil
        budget, kv_type = self.kv_budget_bytes, engine.kv_cache_type
        if budget is None:
            context_bytes = (int(engine.max_context) + self.block_tokens) * kv_bytes_per_token(engine.config, kv_type)
            budget = max(context_bytes, min(DEFAULT_KV_BUDGET_BYTES, self.max_batch_seqs * context_bytes))
            budget = min(budget, max(psutil.virtual_memory().available // 4,
                                     self.block_tokens * kv_bytes_per_token(engine.config, kv_type)))
        else:
            available = psutil.virtual_memory().available
            if budget > 0.9 * available:  # an out-of-memory kill (or an allocator traceback) otherwise
                raise TandemError(f"--kv-budget ({budget} bytes) is more than the memory available now can hold "
                                  f"({available} bytes free; keep it under 90% of that)")
        return KVPool.create(engine.config, budget, self.block_tokens, kv_type)
