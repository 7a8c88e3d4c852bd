"""The multi-token step (speculative verification, continuous batching) against the single-token
fused step: several tokens of one sequence (``step_many``) and tokens of several sequences over a
paged KV layout (``step_batch``) give bit-identical logits and KV rows."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from online.execution.fused_decode import FusedDecodeStep
from tandem.core.kv_cache import KVCache
from tandem.core.errors import TandemError
from test_fused_decode import PROMPT, packed


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["llama", "mistral", "llama-mqa"])
def test_step_many_equals_single_steps(tiny_model_dir, kind, kv_dtype):
    folder, _ = tiny_model_dir(kind)
    model, executor = packed(folder, "int4", thresholds=[0.02] * 2)
    step = FusedDecodeStep.build(model, executor)
    single, multi = KVCache(model.cfg, 40, dtype=kv_dtype), KVCache(model.cfg, 40, dtype=kv_dtype)
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


# --- the multi-token row kernels -------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int8", "int8b", "fp32"])
@pytest.mark.parametrize("ratio", [-1.0, 2.0])
def test_multi_token_row_kernels_equal_single_token_rows(fmt, ratio):
    """dot_rows_multi (one weight read, T tokens) == dot_rows per token, bit for bit, tails included."""
    from online.kernels import native
    from online.kernels.native.structs import describe
    from online.kernels.quantize import Fp32Weight, quantize
    lib = native.load_native().lib
    rng = np.random.default_rng(3)
    w = rng.standard_normal((11, 192)).astype(np.float32)
    weight = Fp32Weight(w) if fmt == "fp32" else quantize(w, fmt.split("-")[0], 64 if fmt.endswith("g64") else 32)
    d = describe(weight)
    for T in (1, 2, 3, 5):
        x = rng.standard_normal((T, 192)).astype(np.float32)
        x[:, 37] = 40.0 * (1 + np.arange(T))  # outlier blocks (residual pass where ratio >= 0)
        for r0, n in ((0, 11), (1, 8), (6, 3)):
            got = np.zeros((T, n), np.float32)
            lib.tdm_dot_rows_multi(ctypes.byref(d.desc), r0, n, T, x.ctypes.data, ratio, got.ctypes.data)
            for i in range(T):
                want = np.zeros(n, np.float32)
                lib.tdm_dot_rows(ctypes.byref(d.desc), r0, n, x[i].ctypes.data, ratio, want.ctypes.data)
                assert np.array_equal(got[i], want), (T, r0, n, i)


# --- step_many: T tokens of one sequence ----------------------------------------------------

def _singles_and_many(step, executor, cfg, history, chunks, capacity=64):
    """Run the same tokens through single steps and through step_many chunks; return both sides."""
    single, multi = KVCache(cfg, capacity), KVCache(cfg, capacity)
    for pos, tok in enumerate(history):
        step(tok, pos, single), step(tok, pos, multi)
    pos = len(history)
    for tokens in chunks:
        c0 = executor.counters.ffn_neurons_active
        want = torch.stack([step(t, pos + i, single) for i, t in enumerate(tokens)])
        c1 = executor.counters.ffn_neurons_active
        got = step.step_many(tokens, pos, multi)
        c2 = executor.counters.ffn_neurons_active
        assert got.shape == want.shape and torch.equal(got, want), (len(tokens), pos)
        assert c2 - c1 == c1 - c0  # the same sparse neuron counts
        pos += len(tokens)
    assert torch.equal(multi.keys, single.keys) and torch.equal(multi.values, single.values)


CHUNKS = [[11], [12, 13, 14], list(range(20, 28)), list(range(30, 46))]  # T = 1, 3, 8, 16; crosses window 16


@pytest.mark.parametrize("kind", ["llama", "llama-relu", "qwen2", "mistral"])
# fp32 weights never reach the fused step (float32 attention); fp32 rows: the row-kernel test, fp32 predictors
@pytest.mark.parametrize("fmt,down", [("int4", "fp16"), ("int8", "int8b"), ("int8", "int8"), ("int4", "fp32")])
def test_step_many_equals_single_steps_every_format(tiny_model_dir, kind, fmt, down):
    folder, _ = tiny_model_dir(kind)
    thresholds = [0.0 if kind == "llama-relu" else 0.02] * 2  # sparse down rows; llama-relu: the gate cut
    model, executor = packed(folder, fmt, thresholds=thresholds, down_format=down)
    step = FusedDecodeStep.build(model, executor)
    _singles_and_many(step, executor, model.cfg, PROMPT, CHUNKS)


def test_step_many_dense_and_residual_every_block(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2")
    model, executor = packed(folder, "int4")  # no thresholds: every neuron
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    _singles_and_many(step, executor, model.cfg, PROMPT[:2], CHUNKS)


@pytest.mark.parametrize("predictor_format", ["fp32", "int8"])
@pytest.mark.parametrize("act", ["relu", "silu"])
def test_step_many_with_predictor_layers(tiny_model_dir, act, predictor_format):
    from test_fused_predict import packed as packed_act, random_gates
    folder, _ = tiny_model_dir("llama-relu")
    model, executor = packed_act(folder, act, predictors=random_gates(64, 128, 2), fmt="int4")
    step = FusedDecodeStep.build(model, executor, predictor_format=predictor_format)
    before = step.predictor_rows()
    _singles_and_many(step, executor, model.cfg, PROMPT, CHUNKS[:3])
    assert step.predictor_rows()[0] > before[0]  # the predictor ran


# --- step_batch: tokens of several sequences over a paged pool ------------------------------

@pytest.mark.parametrize("block_tokens,kv_dtype", [(16, torch.float32), (4, torch.float32), (4, torch.float16)])
@pytest.mark.parametrize("kind", ["llama", "mistral", "llama-mqa"])
def test_step_batch_several_sequences_random_tables(tiny_model_dir, block_tokens, kind, kv_dtype):
    """Rounds of mixed prefill chunks and decode tokens of four sequences, interleaved in one batch,
    against each sequence alone on a contiguous cache; random block tables, random logits_for. With one
    KV group of four heads (llama-mqa) the two threads split a group's heads in both steps. A float16
    pool against float16 caches as well."""
    folder, _ = tiny_model_dir(kind)
    model, executor = packed(folder, "int4", thresholds=[0.02] * 2)
    step = FusedDecodeStep.build(model, executor)
    cfg, n_blocks = model.cfg, 48
    storage = KVCache(cfg, block_tokens * n_blocks, dtype=kv_dtype)
    pool = SimpleNamespace(keys=storage.keys, values=storage.values, block_tokens=block_tokens)
    rng = np.random.default_rng(block_tokens)
    free = [int(b) for b in rng.permutation(n_blocks)]
    per_seq = 40 // block_tokens + 1
    tables = [np.array([free.pop() for _ in range(per_seq)], dtype=np.int32) for _ in range(4)]
    refs = [KVCache(cfg, 40, dtype=kv_dtype) for _ in range(4)]
    length = [0, 0, 0, 0]
    for round_sizes in ([5, 1, 0, 9], [1, 7, 3, 1], [1, 1, 1, 1], [12, 0, 2, 1], [1, 9, 1, 0]):
        items = []  # (sequence, token, position)
        for s, k in enumerate(round_sizes):
            items += [(s, int(rng.integers(0, cfg.vocab_size)), length[s] + j) for j in range(k)]
            length[s] += k
        order = sorted(range(len(items)), key=lambda i: (items[i][2], rng.random()))  # interleaved, each in order
        items = [items[i] for i in order]
        wanted = [bool(rng.random() < 0.6) for _ in items]
        want = [step(tok, pos, refs[s]) for (s, tok, pos) in items]
        got = step.step_batch([t for _, t, _ in items], [p for _, _, p in items], [tables[s] for s, _, _ in items],
                              pool, wanted)
        expected = [w for w, keep in zip(want, wanted) if keep]
        assert got.shape[0] == len(expected)
        if expected:
            assert torch.equal(got, torch.stack(expected))
    for s in range(4):
        rows = [int(tables[s][p // block_tokens]) * block_tokens + p % block_tokens for p in range(length[s])]
        assert torch.equal(pool.keys[:, :, rows], refs[s].keys[:, :, :length[s]])
        assert torch.equal(pool.values[:, :, rows], refs[s].values[:, :, :length[s]])


def test_step_batch_splits_long_calls_in_order(tiny_model_dir):
    """More tokens than one C call takes (a long prefill chunk): split in order, still exact."""
    from online.kernels.native.step_calls import MAX_BATCH_TOKENS
    folder, _ = tiny_model_dir("llama")
    model, executor = packed(folder, "int8", thresholds=[0.02] * 2)
    step = FusedDecodeStep.build(model, executor)
    n = MAX_BATCH_TOKENS + 6
    tokens = [(7 * i + 1) % model.cfg.vocab_size for i in range(n)]
    single, multi = KVCache(model.cfg, n), KVCache(model.cfg, n)
    want = torch.stack([step(t, p, single) for p, t in enumerate(tokens)])
    mask = [p % 5 == 0 or p == n - 1 for p in range(n)]
    got = step.step_batch(tokens, list(range(n)), [[0]] * n, multi, mask)
    assert torch.equal(got, want[torch.tensor(mask)])
    assert torch.equal(multi.keys, single.keys) and torch.equal(multi.values, single.values)


# --- the real model ---------------------------------------------------------------------------

def test_smollm2_step_many_equals_single_steps(smollm2_int4_engine):
    engine = smollm2_int4_engine
    step = engine.compiled_decode
    _singles_and_many(step, engine.executor, engine.model.cfg, [1, 504, 3250, 28], [list(range(100, 108))], 16)


# --- bad inputs -------------------------------------------------------------------------------

def test_bad_inputs_are_one_line_errors(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    model, executor = packed(folder, "int4")
    step = FusedDecodeStep.build(model, executor)
    cache = KVCache(model.cfg, 8)
    pool = SimpleNamespace(keys=cache.keys, values=cache.values, block_tokens=4)  # two blocks
    vocab = model.cfg.vocab_size
    bad = [
        lambda: step.step_many([], 0, cache),
        lambda: step.step_many([1, 2, 3], 6, cache),  # past the cache
        lambda: step.step_many([1, vocab], 0, cache),
        lambda: step.step_many([1, -1], 0, cache),
        lambda: step.step_many(["x"], 0, cache),
        lambda: step.step_many([1.5], 0, cache),
        lambda: step.step_batch([], [], [], pool),
        lambda: step.step_batch([1, 2], [0], [[0], [1]], pool),
        lambda: step.step_batch([1], [0, 1], [[0]], pool),
        lambda: step.step_batch([1], [4], [[0]], pool),  # position past the table
        lambda: step.step_batch([1], [-1], [[0]], pool),
        lambda: step.step_batch([1], [0], [[2]], pool),  # a block outside the pool
        lambda: step.step_batch([vocab], [0], [[0]], pool),
        lambda: step.step_batch([1, 2], [0, 1], [[0], [0]], pool, [True]),
        lambda: step.step_batch([1], [0], [[0]], SimpleNamespace(keys=cache.keys, values=cache.values, block_tokens=3)),
        lambda: step.step_batch([1, 2], [5, 1], [[0, 1], [1]], pool),  # both write row 5
        lambda: step.step_batch([1], [0], [[0]], SimpleNamespace(keys=cache.keys[:, :, :5], values=cache.values[:, :, :5],
                                                                 block_tokens=5)),  # not contiguous
    ]
    for call in bad:
        with pytest.raises(TandemError) as info:
            call()
        assert "\n" not in str(info.value) and str(info.value)
    assert torch.equal(cache.keys, torch.zeros_like(cache.keys))  # nothing half-written


def test_layer_offload_step_goes_token_by_token(tiny_model_dir):
    """LayerOffloadStep runs its tier layers outside C: its step_many / step_batch use its own step."""
    from online.engine import Engine
    from online.execution.layer_offload import layer_tier_bytes
    folder, _ = tiny_model_dir("llama")
    probe = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=0)
    budget = layer_tier_bytes(probe.config, "q8", torch.float16, probe.max_context) + 100
    engine = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=budget)
    assert engine.layer_offload_gpu_layers == 1
    step, cfg = engine.compiled_decode, engine.model.cfg
    single, multi = KVCache(cfg, 16), KVCache(cfg, 16)
    want = torch.stack([step(t, p, single) for p, t in enumerate(PROMPT)])
    assert torch.equal(step.step_many(PROMPT[:5], 0, multi), want[:5])
    assert torch.equal(step.step_batch(PROMPT[5:], [5, 6, 7], [[0]] * 3, multi), want[5:])
    assert torch.equal(multi.keys[:, :, :8], single.keys[:, :, :8])


def test_back_to_back_calls_on_one_cache_and_a_second_cache(tiny_model_dir):
    """The layers stay bound between calls on one cache; a different cache (or a pool of another size)
    rebinds them; single steps in between still see their own cache."""
    folder, _ = tiny_model_dir("qwen2")
    model, executor = packed(folder, "int4", thresholds=[0.02] * 2)
    step = FusedDecodeStep.build(model, executor)
    ref, a, b = KVCache(model.cfg, 24), KVCache(model.cfg, 24), KVCache(model.cfg, 32)
    want = torch.stack([step(t, p, ref) for p, t in enumerate(PROMPT * 2)])
    got = torch.cat([step.step_many(PROMPT[:3], 0, a), step.step_many(PROMPT[3:], 3, a), step.step_many(PROMPT, 8, a)])
    assert torch.equal(got, want)
    got_b = torch.cat([step.step_many(PROMPT[:5], 0, b), torch.stack([step(t, 5 + i, b) for i, t in enumerate(PROMPT[5:])]),
                       step.step_many(PROMPT, 8, b)])
    assert torch.equal(got_b, want)
    assert torch.equal(a.keys, ref.keys) and torch.equal(b.keys[:, :, :24], ref.keys)
