"""Attention over a long context in parts (attend_parts.h, flash-decoding's split-K): a head's context of more
than TDM_SEGMENT_POSITIONS positions is attended in equal parts, each with its own maximum, and the parts
merged by their maxima; the parts of one token go to different threads. Checked against numpy's softmax
attention in float64, for any thread count (the split depends on the context alone, so the values are the
same bit for bit), and through the whole step against the torch statement of its arithmetic and against
its own multi-token and batched paths."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from online.execution.fused_decode import FusedDecodeStep
from online.kernels import native
from tandem.core.kv_cache import KVCache
from helpers_fused import reference_step
from test_fused_decode import packed

ATTEND_PARTS_H = (Path(native.__file__).parent / "attend_parts.h").read_text()
SEGMENT_POSITIONS = int(re.search(r"#define TDM_SEGMENT_POSITIONS (\d+)", ATTEND_PARTS_H)[1])


def _attend(lib, k, v, q, rep: int, threads: int) -> np.ndarray:
    """tdm_attend_pass_timed (probe.h): the step's (group, part, head) units on ``threads`` threads."""
    n_kv, rows, hd = k.shape
    out = np.zeros_like(q)
    scores = np.zeros(threads * min(rep, 16) * rows, np.float32)
    fn = lib.tdm_attend_pass_timed
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_double
    assert fn(k.ctypes.data, v.ctypes.data, n_kv, rows, hd, rep, int(k.dtype == np.float16), threads,
              q.ctypes.data, out.ctypes.data, scores.ctypes.data) >= 0
    return out


@pytest.mark.parametrize("parts", [0.8, 1.0, 1.004, 2.7, 8.0])  # context / TDM_SEGMENT_POSITIONS: 1, 1, 2, 3, 8 parts
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_parts_equal_softmax_attention_on_any_thread_count(parts, dtype):
    rows = round(parts * SEGMENT_POSITIONS)
    lib = native.load_native().lib
    rng = np.random.default_rng(rows)
    n_kv, rep, hd = 3, 3, 64  # SmolLM2's grouping: 9 query heads do not split evenly between 2 threads
    k = (rng.standard_normal((n_kv, rows, hd)) * 2.0).astype(dtype)  # [KV, rows, hd]
    v = rng.standard_normal((n_kv, rows, hd)).astype(dtype)  # [KV, rows, hd]
    q = rng.standard_normal((n_kv * rep, hd)).astype(np.float32)  # [H, hd]
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    want = np.empty((n_kv * rep, hd))
    for h in range(n_kv * rep):
        s = 0.125 * (k64[h // rep] @ q[h].astype(np.float64))  # [rows]
        p = np.exp(s - s.max())
        want[h] = (p / p.sum()) @ v64[h // rep]
    outs = [_attend(lib, k, v, q, rep, threads) for threads in (1, 2, 3)]
    np.testing.assert_allclose(outs[0], want, rtol=2e-5, atol=2e-6)
    for other in outs[1:]:
        assert np.array_equal(other, outs[0])


def _long_llama(tmp_path, heads: int, kv_heads: int):
    import transformers as tf
    torch.manual_seed(5)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=96, max_position_embeddings=4 * SEGMENT_POSITIONS)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path)
    return tmp_path


def test_long_context_steps_match_the_reference(tmp_path):
    """Past one part, with 6 query heads on 2 KV heads: each step's logits equal the torch statement of the
    step's arithmetic (whole-context softmax). The history up to just before the first split comes from the
    step itself (its rows against the statement's: the short-context tests), copied into the statement's
    cache; then both run the steps from one part into two. Three parts and more: the numpy test above, and
    the paths' test below."""
    model, executor = packed(_long_llama(tmp_path, 6, 2), "int4")
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    tokens = [(37 * i + 11) % 128 for i in range(SEGMENT_POSITIONS + 40)]
    first = SEGMENT_POSITIONS - 24  # the last one-part steps, then the first two-part ones
    cache, ref_cache = KVCache(model.cfg, len(tokens)), KVCache(model.cfg, len(tokens))
    step.step_many(tokens[:first], 0, cache)
    ref_cache.keys.copy_(cache.keys), ref_cache.values.copy_(cache.values)
    for pos in range(first, len(tokens)):
        got = step(tokens[pos], pos, cache)
        ref, _ = reference_step(model, executor, ref_cache, tokens[pos], pos, residual_ratio=0.0)
        torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_long_context_multi_token_and_batched_paths_equal_single_steps(tmp_path, kv_dtype):
    """Past two and three parts, step_many and step_batch (paged, two sequences) give the single steps'
    logits and KV rows bit for bit: every path splits a context the same way."""
    model, executor = packed(_long_llama(tmp_path, 6, 2), "int4")
    step, cfg = FusedDecodeStep.build(model, executor), model.cfg
    lengths, extra, block_tokens = (2 * SEGMENT_POSITIONS + 20, SEGMENT_POSITIONS + 30), 6, 16
    histories = [[(31 * i + 7 * s) % 128 for i in range(n + extra)] for s, n in enumerate(lengths)]
    refs = [KVCache(cfg, len(h), dtype=kv_dtype) for h in histories]
    want = [[step(t, p, refs[s]) for p, t in enumerate(h)] for s, h in enumerate(histories)]
    many = KVCache(cfg, len(histories[0]), dtype=kv_dtype)
    step.step_many(histories[0][:lengths[0]], 0, many)
    got = step.step_many(histories[0][lengths[0]:], lengths[0], many)  # [extra, vocab]
    assert torch.equal(got, torch.stack(want[0][lengths[0]:]))
    assert torch.equal(many.keys, refs[0].keys) and torch.equal(many.values, refs[0].values)
    per_seq = max(len(h) for h in histories) // block_tokens + 1
    storage = KVCache(cfg, 2 * per_seq * block_tokens, dtype=kv_dtype)
    pool = SimpleNamespace(keys=storage.keys, values=storage.values, block_tokens=block_tokens)
    blocks = np.random.default_rng(1).permutation(2 * per_seq).astype(np.int32)
    tables = [blocks[s * per_seq:(s + 1) * per_seq] for s in range(2)]
    for s, n in enumerate(lengths):  # the histories, in calls of 64 tokens
        for a in range(0, n, 64):
            b = min(a + 64, n)
            step.step_batch(histories[s][a:b], list(range(a, b)), [tables[s]] * (b - a), pool, [False] * (b - a))
    tokens, positions, token_tables = [], [], []
    for j in range(extra):  # the two sequences' last tokens interleaved, each in order
        for s, n in enumerate(lengths):
            tokens.append(histories[s][n + j]), positions.append(n + j), token_tables.append(tables[s])
    got = step.step_batch(tokens, positions, token_tables, pool)
    assert torch.equal(got, torch.stack([want[s][n + j] for j in range(extra) for s, n in enumerate(lengths)]))
