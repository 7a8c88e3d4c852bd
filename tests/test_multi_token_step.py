"""The multi-token step (speculative verification, continuous batching) against the single-token
fused step: several tokens of one sequence (``step_many``) and tokens of several sequences over a
paged KV layout (``step_batch``) give bit-identical logits and KV rows."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from online.execution.fused_decode import FusedDecodeStep
from online.kv_cache import KVCache
from test_fused_decode import PROMPT, packed


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_step_many_equals_single_steps(tiny_model_dir, kind):
    folder, _ = tiny_model_dir(kind)
    model, executor = packed(folder, "int4", thresholds=[0.02] * 2)
    step = FusedDecodeStep.build(model, executor)
    single, multi = KVCache(model.cfg, 40), KVCache(model.cfg, 40)
    for pos, tok in enumerate(PROMPT):  # a shared history
        step(tok, pos, single), step(tok, pos, multi)
    tokens = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # crosses mistral's window (16)
    want = torch.stack([step(t, len(PROMPT) + i, single) for i, t in enumerate(tokens)])
    got = step.step_many(tokens, len(PROMPT), multi)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(multi.keys, single.keys) and torch.equal(multi.values, single.values)


def test_step_batch_over_paged_blocks_equals_contiguous_single_steps(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    model, executor = packed(folder, "int4")
    step = FusedDecodeStep.build(model, executor)
    cfg, block_tokens, n_blocks = model.cfg, 4, 16
    storage = KVCache(cfg, block_tokens * n_blocks)  # a paged pool's storage: [L, KV, blocks*4, hd]
    pool = SimpleNamespace(keys=storage.keys, values=storage.values, block_tokens=block_tokens)
    rng = np.random.default_rng(0)
    free = list(rng.permutation(n_blocks))
    seqs = [PROMPT[:3], PROMPT, [7, 8]]
    tables = [np.array([free.pop() for _ in range(4)], dtype=np.int32) for _ in seqs]
    refs = [KVCache(cfg, 16) for _ in seqs]
    want = []
    tokens, positions, token_tables, wanted = [], [], [], []
    for s, ids in enumerate(seqs):
        for pos, tok in enumerate(ids):
            logits = step(tok, pos, refs[s])
            keep = pos == len(ids) - 1 or s == 1
            want += [logits] if keep else []
            tokens.append(tok), positions.append(pos), token_tables.append(tables[s]), wanted.append(keep)
    got = step.step_batch(tokens, positions, token_tables, pool, wanted)
    assert torch.equal(got, torch.stack(want))
    for s, ids in enumerate(seqs):
        rows = [int(tables[s][p // block_tokens]) * block_tokens + p % block_tokens for p in range(len(ids))]
        assert torch.equal(pool.keys[:, :, rows], refs[s].keys[:, :, :len(ids)])
        assert torch.equal(pool.values[:, :, rows], refs[s].values[:, :, :len(ids)])
