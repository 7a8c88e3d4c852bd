"""The paged KV pool against a naive model: every owner's rows keep exactly the tokens it wrote,
ref counts equal the owners holding each block, cached blocks are reused least recently used first,
and the pool returns to empty."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from online.kv_pool import KVPool, PoolExhausted
from tandem.core.errors import TandemError

CFG = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=2)
BT = 4


def write(pool: KVPool, table: list[int], pos: int, token: int) -> None:
    """Store ``token`` as the row's key (the naive model reads it back)."""
    block_index = pos // BT
    pool.writable(table, block_index)
    row = table[block_index] * BT + pos % BT
    pool.keys[0, 0, row, 0] = float(token)


def read(pool: KVPool, table: list[int], n: int) -> list[int]:
    return [int(pool.keys[0, 0, table[p // BT] * BT + p % BT, 0]) for p in range(n)]


def test_random_owners_match_a_naive_model():
    rng = random.Random(0)
    pool = KVPool(CFG, n_blocks=24, block_tokens=BT)
    owners: list[dict] = []  # naive model: each owner's tokens and its table
    for _ in range(600):
        op = rng.random()
        if op < 0.3 and len(owners) < 8:  # a new sequence, sharing a cached prefix when one exists
            tokens = [rng.choice([1, 2]) for _ in range(rng.randint(1, 14))]
            hashes = pool.block_hashes(tokens)[:(len(tokens) - 1) // BT]
            hits = pool.count_prefix(hashes)
            need = pool.blocks_for(len(tokens)) - hits + pool.cached_unreferenced(hashes[:hits])
            if not pool.can_allocate(need):
                continue
            table = pool.take_prefix(hashes[:hits])
            assert read(pool, table, hits * BT) == tokens[:hits * BT]  # a hit holds these very tokens
            table += pool.allocate(pool.blocks_for(len(tokens)) - hits)
            for p in range(hits * BT, len(tokens)):
                write(pool, table, p, tokens[p])
            for i, h in enumerate(pool.block_hashes(tokens)):
                pool.register(h, table[i])
            owners.append({"tokens": tokens, "table": table})
        elif op < 0.45 and owners:  # fork (n > 1): shares every block
            src = rng.choice(owners)
            owners.append({"tokens": list(src["tokens"]), "table": pool.fork(src["table"])})
        elif op < 0.8 and owners:  # append a token (copy on write of a shared partial block)
            o = rng.choice(owners)
            pos = len(o["tokens"])
            if pos % BT == 0:
                if not pool.can_allocate(2):
                    continue
                o["table"] += pool.allocate(1)
            elif not pool.can_allocate(1):
                continue
            token = rng.choice([1, 2, 3])
            write(pool, o["table"], pos, token)
            o["tokens"].append(token)
            if (pos + 1) % BT == 0:
                pool.register(pool.block_hashes(o["tokens"])[-1], o["table"][-1])
        elif owners:
            o = owners.pop(rng.randrange(len(owners)))
            pool.free(o["table"])
        for o in owners:
            assert read(pool, o["table"], len(o["tokens"])) == o["tokens"]
        held = [0] * pool.n_blocks
        for o in owners:
            for b in o["table"]:
                held[b] += 1
        assert held == pool.refs
        assert pool.n_used == sum(1 for r in held if r)
    for o in owners:
        pool.free(o["table"])
    pool.check_empty()
    assert pool.n_free == pool.n_blocks
    assert pool.counters.copies > 0 and pool.counters.evictions > 0


def test_cached_blocks_are_reused_lru_and_revived_by_a_hit():
    pool = KVPool(CFG, n_blocks=3, block_tokens=BT)
    seqs = [[i] * BT for i in (1, 2, 3)]
    tables = []
    for tokens in seqs:
        table = pool.allocate(1)
        pool.register(pool.block_hashes(tokens)[0], table[0])
        tables.append(table)
    for table in (tables[1], tables[0], tables[2]):  # LRU order: 2, 1, 3
        pool.free(table)
    assert pool.take_prefix(pool.block_hashes(seqs[1])) == tables[1]  # a hit revives block of "2"
    (evicted,) = pool.allocate(1)
    assert evicted == tables[0][0] and pool.counters.evictions == 1  # the least recently freed other block
    assert pool.count_prefix(pool.block_hashes(seqs[0])) == 0  # its hash is gone
    assert pool.count_prefix(pool.block_hashes(seqs[2])) == 1
    with pytest.raises(PoolExhausted):
        pool.allocate(2)


def test_block_hashes_chain_the_prefix():
    pool = KVPool(CFG, n_blocks=2, block_tokens=BT)
    a = pool.block_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = pool.block_hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[1] != b[1]  # same second block, different parent
    assert pool.block_hashes([1, 2, 3, 4, 5, 6, 7]) == a[:1]  # only full blocks
    with pytest.raises(TandemError, match="freed twice"):
        pool.free([0])
    with pytest.raises(TandemError, match="smaller than one KV block"):
        KVPool.create(CFG, kv_budget_bytes=8, block_tokens=BT)


@pytest.mark.parametrize("kv_type,element_bytes", [("f16", 2), ("f32", 4)])
def test_pool_budget_counts_the_cache_type_and_rejects_unknown_types(kv_type, element_bytes):
    """A budget buys blocks of keys + values of every layer's KV heads at the type's element size (float16: twice
    the tokens of float32 in the same bytes); an unknown type is a one-line error."""
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8)
    block_bytes = BT * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element_bytes
    pool = KVPool.create(cfg, kv_budget_bytes=5 * block_bytes + 1, block_tokens=BT, kv_cache_type=kv_type)
    assert pool.n_blocks == 5 and pool.nbytes == 5 * block_bytes and pool.kv_cache_type == kv_type
    for make in (lambda: KVPool(cfg, 2, BT, kv_cache_type="bf16"), lambda: KVPool.create(cfg, 1 << 20, BT, "q8")):
        with pytest.raises(TandemError, match="kv_cache_type must be one of f16, f32"):
            make()
