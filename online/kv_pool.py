"""Paged KV pool: fixed-size blocks in one storage, ref counts, prefix caching, copy on write.

Storage is ``keys``/``values`` ``[L, KV, n_blocks * block_tokens, hd]`` in float16 (the default) or float32
(the layout the fused step's ``step_batch`` reads, see tandem/core/kv_cache.py). A sequence owns a block table; its position p
lives at row ``table[p // block_tokens] * block_tokens + p % block_tokens``.

Prefix caching (vLLM's automatic prefix caching): a *full* block's id is the hash of its parent
block's id and its own tokens, so a block id names the whole prefix up to its end. A full block is
registered under its id; a later sequence whose prompt starts with the same tokens takes the block
(ref count + 1) instead of recomputing it. A block whose ref count drops to 0 stays cached (free but
reusable) until the pool needs room; then the least recently used cached block is evicted.
A shared block about to be written (a fork's partial last block) is copied first (copy on write).

Example::

    pool = KVPool.create(cfg, kv_budget_bytes=256 << 20, block_tokens=16)
    hashes = pool.block_hashes(prompt_ids)                   # one per full block
    table = pool.take_prefix(hashes)                         # the cached leading blocks, refs taken
    table += pool.allocate(pool.blocks_for(len(prompt_ids)) - len(table))
    pool.register(hashes[i], table[i])                       # once block i is written and full
    pool.free(table)                                         # ref counts down; cached blocks stay reusable
"""
from __future__ import annotations

import collections
import hashlib
import math
from dataclasses import dataclass

import torch

from tandem.core.errors import TandemError
from tandem.core.config import kv_row_bytes
from tandem.core.huge_pages import huge_page_tensor

DEFAULT_BLOCK_TOKENS = 16


class PoolExhausted(Exception):
    """Not enough free blocks (the scheduler preempts or waits)."""


@dataclass
class PoolCounters:
    hits_tokens: int = 0  # prompt tokens whose KV came from cached blocks
    evictions: int = 0  # cached blocks dropped to make room
    copies: int = 0  # copy-on-write block copies


KV_TYPES = {"f16": torch.float16, "f32": torch.float32}  # EngineArgs.kv_cache_type -> the storage's dtype


def kv_dtype(kv_cache_type: str) -> torch.dtype:
    """The torch dtype of a KV cache type (EngineArgs.kv_cache_type: f16 / f32)."""
    if kv_cache_type not in KV_TYPES:
        raise TandemError(f"kv_cache_type must be one of {', '.join(KV_TYPES)}, got {kv_cache_type!r}")
    return KV_TYPES[kv_cache_type]


def kv_bytes_per_token(cfg, kv_cache_type: str = "f16") -> int:
    """Keys + values of one token over all layers, in ``kv_cache_type`` (f16 / f32)."""
    return int(cfg.num_layers * kv_row_bytes(cfg, kv_dtype(kv_cache_type).itemsize))


class KVPool:
    """Block allocator over one preallocated key/value storage (see the module docstring)."""

    def __init__(self, cfg, n_blocks: int, block_tokens: int = DEFAULT_BLOCK_TOKENS, kv_cache_type: str = "f16") -> None:
        if n_blocks < 1 or block_tokens < 1:
            raise TandemError(f"a KV pool needs >= 1 block of >= 1 token, got {n_blocks} x {block_tokens}")
        self.cfg = cfg
        self.n_blocks = n_blocks
        self.block_tokens = block_tokens
        shape = (cfg.num_layers, cfg.num_kv_heads, n_blocks * block_tokens, cfg.head_dim)
        self.kv_cache_type = kv_cache_type
        dtype = kv_dtype(kv_cache_type)  # on 2 MiB pages: a step reads 2 KiB runs all over (tandem/core/huge_pages.py)
        self.keys = huge_page_tensor(shape, dtype)  # [L, KV, n_blocks*bt, hd]
        self.values = huge_page_tensor(shape, dtype)  # [L, KV, n_blocks*bt, hd]
        self.refs = [0] * n_blocks
        self._free: collections.deque[int] = collections.deque(range(n_blocks))  # never-hashed free blocks
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU order: oldest first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.counters = PoolCounters()

    @classmethod
    def create(cls, cfg, kv_budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS,
               kv_cache_type: str = "f16") -> "KVPool":
        """As many blocks as ``kv_budget_bytes`` holds (at least one)."""
        block_bytes = kv_bytes_per_token(cfg, kv_cache_type) * block_tokens
        n_blocks = kv_budget_bytes // block_bytes
        if n_blocks < 1:
            raise TandemError(f"--kv-budget of {kv_budget_bytes} bytes is smaller than one KV block "
                              f"({block_bytes} bytes for {block_tokens} tokens)")
        return cls(cfg, int(n_blocks), block_tokens, kv_cache_type)

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_tokens)

    @property
    def n_free(self) -> int:
        """Blocks that can be handed out now (free + cached-but-unreferenced)."""
        return len(self._free) + len(self._cached_free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.n_free

    # --- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref count 1; never-hashed free blocks first, then the LRU cached ones."""
        if n > self.n_free:
            raise PoolExhausted(f"{n} blocks wanted, {self.n_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached_free.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
                self.counters.evictions += 1
            self.refs[block] = 1
            out.append(block)
        return out

    def fork(self, table: list[int]) -> list[int]:
        """A second owner of the same blocks (n > 1 choices share the prompt's KV)."""
        for block in table:
            self.refs[block] += 1
        return list(table)

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block; unreferenced hashed blocks stay cached (LRU)."""
        for block in table:
            if self.refs[block] <= 0:
                raise TandemError(f"KV block {block} freed twice")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._hash_of:
                    self._cached_free[block] = None  # most recently used at the end
                else:
                    self._free.append(block)

    def writable(self, table: list[int], block_index: int) -> None:
        """Copy on write: make ``table[block_index]`` private to this table before it is written."""
        block = table[block_index]
        if self.refs[block] == 1 and block not in self._hash_of:
            return
        if self.refs[block] == 1:  # private but registered: writing would corrupt the cached prefix
            del self._by_hash[self._hash_of.pop(block)]
            return
        (fresh,) = self.allocate(1)
        self._copy_rows(block, fresh)
        self.counters.copies += 1
        self.free([block])
        table[block_index] = fresh

    def _copy_rows(self, src: int, dst: int) -> None:
        bt = self.block_tokens
        self.keys[:, :, dst * bt:(dst + 1) * bt] = self.keys[:, :, src * bt:(src + 1) * bt]
        self.values[:, :, dst * bt:(dst + 1) * bt] = self.values[:, :, src * bt:(src + 1) * bt]

    # --- prefix caching ------------------------------------------------------------------------
    def block_hashes(self, token_ids: list[int]) -> list[bytes]:
        """Chained ids of the full blocks of ``token_ids``: id_i = H(id_{i-1}, tokens of block i)."""
        out, parent = [], b""
        bt = self.block_tokens
        for begin in range(0, len(token_ids) - bt + 1, bt):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(b",".join(str(int(t)).encode() for t in token_ids[begin:begin + bt]))
            parent = h.digest()
            out.append(parent)
        return out

    def take_prefix(self, hashes: list[bytes]) -> list[int]:
        """The longest run of cached blocks matching ``hashes`` from the start, each with a ref taken."""
        table = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                del self._cached_free[block]
            self.refs[block] += 1
            table.append(block)
        return table

    def count_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks ``take_prefix`` would return (no refs taken)."""
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def cached_unreferenced(self, hashes: list[bytes]) -> int:
        """Of the leading cached blocks, how many sit in the free LRU (taking them uses free room)."""
        n = 0
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            n += self.refs[block] == 0
        return n

    def register(self, block_hash: bytes, block: int) -> None:
        """Publish a written full block under its chained hash (first writer wins)."""
        if block_hash in self._by_hash or block in self._hash_of:
            return
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash

    def check_empty(self) -> None:
        """Raise unless every block is unreferenced (no leaked blocks)."""
        leaked = [b for b, r in enumerate(self.refs) if r]
        if leaked:
            raise TandemError(f"{len(leaked)} KV blocks still referenced: {leaked[:8]}")
