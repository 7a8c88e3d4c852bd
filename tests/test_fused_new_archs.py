"""The fused C decode step on Qwen3 (q/k head norms) and Gemma 3 (q/k norms, sandwich norms, scaled
embeddings, query_pre_attn_scalar, softcapped logits, GELU-tanh, windowed layers on their own rope
table between global ones): against the module path on the same packed weights, transformers,
and its own multi-token step (bit-identical)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from online.execution.fused_decode import FusedDecodeStep
from tandem.core.generate import decode_one_token, prefill
from tandem.core.kv_cache import KVCache
from test_fused_decode import PROMPT, packed
from test_multi_token_step import CHUNKS, _singles_and_many

KINDS = ["qwen3", "gemma3"]
DECODE = [3, 99, 4, 5, 6, 7, 8, 9, 10, 11]  # positions 8..17: past Gemma's window (8) on its local layers


def _module_and_fused(model, executor, step, tokens):
    """Prefill PROMPT through the modules into two caches, then decode ``tokens`` one at a time through
    the module path and through ``step``; returns ([T, vocab] modules, [T, vocab] fused, per-token
    neuron counts of each)."""
    fused_cache, module_cache = KVCache(model.cfg, 40), KVCache(model.cfg, 40)
    prefill(model, executor, fused_cache, PROMPT)
    prefill(model, executor, module_cache, PROMPT)
    ours, ref, n_ours, n_ref = [], [], [], []
    counters = executor.counters
    for i, tok in enumerate(tokens):
        pos = len(PROMPT) + i
        before = counters.ffn_neurons_active
        ours.append(decode_one_token(model, executor, fused_cache, tok, pos, step))
        mid = counters.ffn_neurons_active
        ref.append(decode_one_token(model, executor, module_cache, tok, pos))
        n_ours.append(mid - before), n_ref.append(counters.ffn_neurons_active - mid)
    return torch.stack(ref), torch.stack(ours), n_ref, n_ours


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fused_step_continues_a_prefill_like_the_module_path(tiny_model_dir, kind, fmt):
    """15-bit activations (residual_ratio 0): the C step is the module path's arithmetic within float
    noise, KV rows included (the windowed layers' keys are roped with their own table)."""
    folder, _ = tiny_model_dir(kind)
    model, executor = packed(folder, fmt)
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    ref, ours, _, _ = _module_and_fused(model, executor, step, DECODE)
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=2e-3)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    if kind == "gemma3":  # the softcap (3.0) bounds every logit
        assert float(ours.abs().max()) <= 3.0


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_gelu_and_silu_thresholds_match_the_module_path(tiny_model_dir, kind):
    """Magnitude thresholds on |act(gate)·up| (GELU-tanh for Gemma, SiLU for Qwen3): the C step adds
    the same down rows as the module path's sparse FFN (a neuron at the threshold may flip)."""
    folder, _ = tiny_model_dir(kind)
    n_layers = 3 if kind == "gemma3" else 2
    model, executor = packed(folder, "int8", thresholds=[0.01] * n_layers)
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    ref, ours, n_ref, n_ours = _module_and_fused(model, executor, step, DECODE[:6])
    total = n_layers * model.cfg.intermediate_size
    assert all(0 < n < total for n in n_ref)  # sparse, not empty
    assert all(abs(a - b) <= 2 for a, b in zip(n_ref, n_ours))
    torch.testing.assert_close(ours, ref, rtol=5e-3, atol=5e-3)


def engine_fused_close_to_transformers(folder, hf_model):
    """An int8 engine of ``folder`` decodes fused, token by token through C, within the weights' rounding
    of transformers' float32 logits and no further from them than the module path; returns the engine."""
    from online.engine import Engine
    engine = Engine.load(folder, weight_format="int8", sparse=False)
    assert engine.decode_path == "fused", engine.decode_path_reason
    engine.compiled_decode = FusedDecodeStep.build(engine.model, engine.executor, residual_ratio=0.0)
    ids = PROMPT + DECODE
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()  # [T, vocab] float32 weights
    ours = engine.step_logits(ids)  # int8 weights
    modules = engine.logits(ids)  # the module path (batched prefill) on the same int8 weights
    err_ours, err_modules = (float((x - ref).norm() / ref.norm()) for x in (ours, modules))
    assert err_ours < 0.05 and err_ours < 1.2 * err_modules + 1e-3  # no error beyond the weights' rounding
    assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9
    return engine


@pytest.mark.parametrize("kind", KINDS)
def test_engine_decodes_through_the_fused_step_close_to_transformers(tiny_model_dir, kind):
    engine = engine_fused_close_to_transformers(*tiny_model_dir(kind))
    out = engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    assert out.stats["decode_path"] == "fused" and len(out.token_ids) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_step_many_equals_single_steps(tiny_model_dir, kind):
    folder, _ = tiny_model_dir(kind)
    n_layers = 3 if kind == "gemma3" else 2
    model, executor = packed(folder, "int4", thresholds=[0.02] * n_layers)
    step = FusedDecodeStep.build(model, executor)
    _singles_and_many(step, executor, model.cfg, PROMPT, CHUNKS)


def test_step_batch_paged_gemma_equals_contiguous_single_steps(tiny_model_dir):
    """Three Gemma sequences in one step over shuffled 4-token blocks: each token's logits and KV rows
    equal the single-token step on its own contiguous cache, bit for bit (windows crossed)."""
    folder, _ = tiny_model_dir("gemma3")
    model, executor = packed(folder, "int8", thresholds=[0.02] * 3)
    step = FusedDecodeStep.build(model, executor)
    cfg, block_tokens, n_blocks = model.cfg, 4, 16
    storage = KVCache(cfg, block_tokens * n_blocks)  # [L, KV, blocks*4, hd]
    pool = SimpleNamespace(keys=storage.keys, values=storage.values, block_tokens=block_tokens)
    free = list(np.random.default_rng(1).permutation(n_blocks))
    seqs = [PROMPT[:3], PROMPT + DECODE[:5], [7, 8]]
    tables = [np.array([free.pop() for _ in range(4)], dtype=np.int32) for _ in seqs]
    refs = [KVCache(cfg, 16) for _ in seqs]
    want, tokens, positions, token_tables = [], [], [], []
    for s, ids in enumerate(seqs):
        for pos, tok in enumerate(ids):
            want.append(step(tok, pos, refs[s]))
            tokens.append(tok), positions.append(pos), token_tables.append(tables[s])
    got = step.step_batch(tokens, positions, token_tables, pool)
    assert torch.equal(got, torch.stack(want))
    for s, ids in enumerate(seqs):
        rows = [int(tables[s][p // block_tokens]) * block_tokens + p % block_tokens for p in range(len(ids))]
        assert torch.equal(pool.keys[:, :, rows], refs[s].keys[:, :, :len(ids)])
        assert torch.equal(pool.values[:, :, rows], refs[s].values[:, :, :len(ids)])


@pytest.mark.parametrize("kind", KINDS)
def test_layer_offload_range_step(tiny_model_dir, kind):
    """No tier layers: the range step (embedding scaled in torch) is the whole-model step, bit for bit.
    One tier layer (through the model's own layer loop: Gemma 3's sandwich norms and local rope table
    included) + the C range: as the module path, within the C step's int8 activations."""
    from online.engine import Engine
    from online.execution.layer_offload import layer_tier_bytes
    folder, _ = tiny_model_dir(kind)
    offload = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=0)
    fused = Engine.load(folder, weight_format="int8")
    assert offload.decode_path == "layer-offload" and fused.decode_path == "fused"
    assert torch.equal(offload.step_logits(PROMPT), fused.step_logits(PROMPT))
    budget = layer_tier_bytes(offload.config, "q8", torch.float16, offload.max_context) + 100
    one = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=budget)
    assert one.layer_offload_gpu_layers == 1
    modules = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=budget,
                          fused_decode=False)
    assert one.decode_path == "layer-offload"
    tol = 0.1 if kind == "gemma3" else 0.02  # int8 activations through Gemma's sandwich norms (softcapped +-3)
    torch.testing.assert_close(one.step_logits(PROMPT), modules.step_logits(PROMPT), rtol=tol, atol=tol)
