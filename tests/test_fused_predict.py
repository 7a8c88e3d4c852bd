"""Predictor-gated sparse rows in the fused C step (predict.h) against the module path's arithmetic."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from online.execution.fused_decode import FusedDecodeStep
from online.execution.gpu_tier import GpuTier
from online.execution.hybrid import ExecutionSettings, HybridExecutor
from online.execution.quantized_linear import quantize_attention
from tandem.core.generate import prefill
from tandem.core.kv_cache import KVCache
from tandem.core.loading.hf_loader import load_hf_folder
from tandem.core.model.build import build_model
from predictors.model import LayerEntry, LayerPredictor, PredictorSet
from predictors.runtime import LayerGate

PROMPT = [5, 17, 42, 9, 77, 3, 101, 64]
ACTS = {"relu": {}, "fatrelu": {"act_threshold": 0.02}, "drelu": {}, "silu": {}}


def packed(folder, act: str, predictors=None, fmt: str = "int8", sparse: bool = True):
    ckpt = load_hf_folder(folder)
    ckpt = dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, hidden_act=act, **ACTS[act]))
    model, ffn_layers = build_model(ckpt)
    thresholds = [0.0 if act != "silu" else 0.01] * model.cfg.num_layers if sparse else None
    settings = ExecutionSettings(weight_format=fmt, down_format="fp32", sparse=sparse)
    executor = HybridExecutor.build(model.cfg, ffn_layers, GpuTier.create(0, "cpu"), settings, thresholds=thresholds,
                                    predictors=predictors, head_weight=model.lm_head.weight)
    quantize_attention(model, fmt, settings.threads)
    return model, executor


def random_gates(d: int, n_ff: int, layers: int, rank: int = 32, seed: int = 0) -> list:
    torch.manual_seed(seed)
    entries = []
    for _ in range(layers):
        p = LayerPredictor(d, rank, n_ff).eval().requires_grad_(False)
        entries.append(LayerEntry("predictor", p, threshold=0.0))  # about half the rows predicted
    pset = PredictorSet(entries)
    return [LayerGate(pset, i) for i in range(layers)]


def perfect_gates(ffn_layers, layers: int) -> list:
    """rank n_ff: z = relu(W_gate x), score = 1000 z: active exactly where the gate is positive."""
    entries = []
    for w in ffn_layers[:layers]:
        n_ff, d = w.gate.shape
        p = LayerPredictor(d, n_ff, n_ff).eval().requires_grad_(False)
        p.down.weight.copy_(w.gate)
        p.down.bias.zero_()
        p.up.weight.copy_(torch.eye(n_ff) * 1000.0)
        p.up.bias.zero_()
        entries.append(LayerEntry("predictor", p, threshold=1e-6))
    pset = PredictorSet(entries)
    return [LayerGate(pset, i) for i in range(layers)]


def module_and_fused(model, executor, predictor_format: str, tokens=(3, 99, 4, 8, 61)):
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0, predictor_format=predictor_format)
    fused_cache, module_cache = KVCache(model.cfg, 32), KVCache(model.cfg, 32)
    prefill(model, executor, fused_cache, PROMPT)
    prefill(model, executor, module_cache, PROMPT)
    out = []
    for i, tok in enumerate(tokens):
        pos = len(PROMPT) + i
        c0 = executor.counters.ffn_neurons_active
        got = step(tok, pos, fused_cache)
        c1 = executor.counters.ffn_neurons_active
        ref = model(torch.tensor([tok]), pos, module_cache, executor)[0]  # module path (C row kernels, float activations)
        c2 = executor.counters.ffn_neurons_active
        out.append((got, ref, c1 - c0, c2 - c1))
    return step, out


@pytest.mark.parametrize("fmt", ["int8", "int4"])  # int4: the gathered four-row kernel
@pytest.mark.parametrize("act", ["relu", "fatrelu", "drelu", "silu"])
def test_predicted_rows_match_the_module_path(tiny_model_dir, act, fmt):
    """Same predicted rows, same neurons used, same logits as the module path (float predictor weights)."""
    folder, _ = tiny_model_dir("llama-relu")
    model, executor = packed(folder, act, predictors=random_gates(64, 128, 2), fmt=fmt)
    step, out = module_and_fused(model, executor, "fp32")
    for got, ref, used_fused, used_module in out:
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
        assert abs(used_fused - used_module) <= 1 and 0 < used_module < 2 * 128
    predicted, computed = step.predictor_rows()
    assert 0 < computed <= predicted < 5 * 2 * 128  # fewer rows than dense


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_int8_predictor_stays_close(tiny_model_dir, act):
    folder, _ = tiny_model_dir("llama-relu")
    model, executor = packed(folder, act, predictors=random_gates(64, 128, 2))
    _, out = module_and_fused(model, executor, "int8")
    for got, ref, used_fused, used_module in out:  # int8 scores may flip rows at the threshold
        assert abs(used_fused - used_module) <= 0.1 * used_module + 2
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.99


@pytest.mark.parametrize("act", ["relu", "fatrelu", "drelu"])
def test_perfect_predictor_gives_the_dense_output(tiny_model_dir, act):
    folder, _ = tiny_model_dir("llama-relu")
    model, executor = packed(folder, act, sparse=False)
    _, ffn_layers = build_model(load_hf_folder(folder))
    pmodel, pexec = packed(folder, act, predictors=perfect_gates(ffn_layers, 2))
    dense = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    gated = FusedDecodeStep.build(pmodel, pexec, residual_ratio=0.0, predictor_format="fp32")
    c_dense, c_gated = KVCache(model.cfg, 32), KVCache(model.cfg, 32)
    for pos, tok in enumerate(PROMPT):
        torch.testing.assert_close(gated(tok, pos, c_gated), dense(tok, pos, c_dense), rtol=1e-4, atol=1e-4)
    predicted, computed = gated.predictor_rows()
    assert 0 < predicted < len(PROMPT) * 2 * 128  # really sparse, yet the same output


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_relu_layers_skip_up_rows_exactly(tiny_model_dir, fmt):
    """ReLU without a predictor: up rows whose gate is <= 0 are skipped; the output is the dense one."""
    folder, _ = tiny_model_dir("llama-relu")
    sparse_model, sparse_exec = packed(folder, "relu", fmt=fmt)
    dense_model, dense_exec = packed(folder, "relu", sparse=False, fmt=fmt)
    a = FusedDecodeStep.build(sparse_model, sparse_exec, residual_ratio=0.0)
    b = FusedDecodeStep.build(dense_model, dense_exec, residual_ratio=0.0)
    ca, cb = KVCache(sparse_model.cfg, 32), KVCache(dense_model.cfg, 32)
    for pos, tok in enumerate(PROMPT):
        torch.testing.assert_close(a(tok, pos, ca), b(tok, pos, cb), rtol=1e-4, atol=1e-4)
