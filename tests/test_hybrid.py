"""Hybrid execution against the dense reference: every split, budgets, sparsity accounting."""
from __future__ import annotations

import pytest
import torch

from tandem.core.ffn import DenseExecutor
from tandem.core.ffn.dense import ffn_hidden
from online.execution.gpu_tier import GpuTier
from online.execution.hybrid import ExecutionSettings, HybridExecutor
from tandem.core.generate import prefill
from tandem.core.kv_cache import KVCache
from tandem.core.loading.hf_loader import load_hf_folder
from tandem.core.model.build import build_model
from tandem.core.errors import TandemError


def load(folder):
    model, ffn_layers = build_model(load_hf_folder(folder))
    return model, ffn_layers


def logits(model, executor, ids):
    return prefill(model, executor, KVCache(model.cfg, 64), ids, all_logits=True)


def random_splits(cfg, fraction: float, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n_hot = int(round(cfg.intermediate_size * fraction))
    return [torch.randperm(cfg.intermediate_size, generator=gen)[:n_hot] for _ in range(cfg.num_layers)]


IDS = [5, 17, 42, 9, 77, 3, 101, 64, 8, 8, 23]


@pytest.mark.parametrize("kind", ["llama", "opt", "llama-relu"])
@pytest.mark.parametrize("gpu_fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("n_tokens", [1, len(IDS)])
def test_all_neurons_active_equals_dense(tiny_model_dir, kind, gpu_fraction, n_tokens):
    """fp32 weights and no sparsity: any hot/cold split (all-CPU, mixed, all-GPU) equals dense."""
    folder, hf_model = tiny_model_dir(kind)
    model, ffn_layers = load(folder)
    ref = logits(model, DenseExecutor(model.cfg, ffn_layers), IDS[:n_tokens])
    tier = GpuTier.create(budget_bytes=1 << 30, device="cpu")
    executor = HybridExecutor.build(model.cfg, ffn_layers, tier, ExecutionSettings(weight_format="fp32", sparse=False),
                                    gpu_neurons=random_splits(model.cfg, gpu_fraction, seed=1))
    torch.testing.assert_close(logits(model, executor, IDS[:n_tokens]), ref, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        hf = hf_model(torch.tensor([IDS[:n_tokens]])).logits[0]
    torch.testing.assert_close(logits(model, executor, IDS[:n_tokens]), hf, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["opt", "llama-relu"])
def test_relu_sparsity_is_exact(tiny_model_dir, kind):
    """ReLU-family layers: skipping exact zeros changes nothing, and the skipped count is right."""
    folder, _ = tiny_model_dir(kind)
    model, ffn_layers = load(folder)
    dense = DenseExecutor(model.cfg, ffn_layers)
    ref = logits(model, dense, IDS[:1])
    tier = GpuTier.create(budget_bytes=1 << 30, device="cpu")
    executor = HybridExecutor.build(model.cfg, ffn_layers, tier, ExecutionSettings(weight_format="fp32", sparse=True),
                                    gpu_neurons=random_splits(model.cfg, 0.25, seed=2))
    torch.testing.assert_close(logits(model, executor, IDS[:1]), ref, rtol=1e-4, atol=1e-5)
    # brute-force count of non-zero h on the CPU (cold) neurons + all GPU neurons
    expected_active = 0
    recorder = _Recorder(dense)
    logits(model, recorder, IDS[:1])
    for layer, h in recorder.hidden.items():
        split = executor.splits[layer]
        expected_active += int((h[:, split.cpu_neurons] != 0).sum()) + h.shape[0] * split.gpu.neurons.numel()
    assert executor.counters.ffn_neurons_active == expected_active
    assert executor.counters.ffn_neurons_total == model.cfg.num_layers * model.cfg.intermediate_size


class _Recorder:
    """Dense executor that keeps each layer's h for a brute-force count."""

    def __init__(self, dense: DenseExecutor) -> None:
        self.dense, self.hidden = dense, {}

    def forward(self, layer, x):
        self.hidden[layer] = ffn_hidden(self.dense.cfg, self.dense.layers[layer], x)
        return self.dense.forward(layer, x)

    def output_logits(self, x, w):
        return self.dense.output_logits(x, w)


def test_threshold_sparsity_matches_masked_reference(tiny_model_dir):
    """SwiGLU exact path: zeroing |h| <= t before the down projection, computed independently."""
    folder, _ = tiny_model_dir("llama")
    model, ffn_layers = load(folder)
    dense = DenseExecutor(model.cfg, ffn_layers)
    x = torch.randn(1, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    w = ffn_layers[0]
    h = ffn_hidden(model.cfg, w, x)
    sorted_abs = h.abs().flatten().sort().values
    middle = sorted_abs.numel() // 2
    t = float(sorted_abs[middle - 1] + sorted_abs[middle]) / 2  # halfway between two values: no ties
    expected = torch.nn.functional.linear(h * (h.abs() > t), w.down)
    executor = HybridExecutor.build(model.cfg, ffn_layers, GpuTier.create(0, "cpu"),
                                    ExecutionSettings(weight_format="fp32", sparse=True),
                                    thresholds=[t] * model.cfg.num_layers)
    torch.testing.assert_close(executor.forward(0, x), expected, rtol=1e-4, atol=1e-6)
    assert executor.counters.ffn_neurons_active == int((h.abs() > t).sum())
    assert dense is not None


def test_gpu_budget_is_enforced(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    model, ffn_layers = load(folder)
    d = model.cfg.hidden_size
    hot = random_splits(model.cfg, 0.5, seed=4)
    need = sum(3 * h.numel() * d * 4 + 8 * h.numel() for h in hot)  # gate, up rows + down columns, float32; int64 index
    with pytest.raises(TandemError, match="GPU budget exceeded"):
        HybridExecutor.build(model.cfg, ffn_layers, GpuTier.create(need - 1, "cpu"),
                             ExecutionSettings(weight_format="fp32", sparse=False), gpu_neurons=hot)
    model, ffn_layers = load(folder)
    tier = GpuTier.create(need, "cpu")
    HybridExecutor.build(model.cfg, ffn_layers, tier, ExecutionSettings(weight_format="fp32", sparse=False),
                         gpu_neurons=hot)
    assert tier.used_bytes == need and tier.peak_bytes <= tier.budget_bytes


@pytest.mark.parametrize("fmt,tolerance", [("int8", 0.03), ("int4", 0.25)])
def test_quantized_formats_stay_close_to_dense(tiny_model_dir, fmt, tolerance):
    folder, _ = tiny_model_dir("llama")
    model, ffn_layers = load(folder)
    ref = logits(model, DenseExecutor(model.cfg, ffn_layers), IDS)
    executor = HybridExecutor.build(model.cfg, ffn_layers, GpuTier.create(0, "cpu"),
                                    ExecutionSettings(weight_format=fmt, sparse=False),
                                    head_weight=model.lm_head.weight)
    out = logits(model, executor, IDS)
    assert float((out - ref).abs().max() / ref.abs().max()) < tolerance


@pytest.mark.parametrize("kind", ["llama-relu", "opt"])
def test_all_ones_predictor_equals_dense(tiny_model_dir, kind):
    folder, _ = tiny_model_dir(kind)
    model, ffn_layers = load(folder)
    ref = logits(model, DenseExecutor(model.cfg, ffn_layers), IDS[:1])
    everything = [lambda x: torch.arange(model.cfg.intermediate_size)] * model.cfg.num_layers
    executor = HybridExecutor.build(model.cfg, ffn_layers, GpuTier.create(1 << 30, "cpu"),
                                    ExecutionSettings(weight_format="fp32", sparse=True),
                                    gpu_neurons=random_splits(model.cfg, 0.25, seed=5), predictors=everything)
    torch.testing.assert_close(logits(model, executor, IDS[:1]), ref, rtol=1e-4, atol=1e-5)


def test_predictor_subset_matches_masked_reference(tiny_model_dir):
    """Neurons the predictor leaves out contribute nothing; the rest are exact."""
    folder, _ = tiny_model_dir("llama-relu")
    model, ffn_layers = load(folder)
    w = ffn_layers[0]
    x = torch.randn(1, model.cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    chosen = torch.arange(0, model.cfg.intermediate_size, 3)
    h = ffn_hidden(model.cfg, w, x)
    keep = torch.zeros_like(h, dtype=torch.bool)
    keep[:, chosen] = True
    hot = torch.tensor([1, 2, 4])  # GPU part: computed densely whatever the predictor says
    keep[:, hot] = True
    expected = torch.nn.functional.linear(h * keep, w.down)
    executor = HybridExecutor.build(model.cfg, ffn_layers, GpuTier.create(1 << 30, "cpu"),
                                    ExecutionSettings(weight_format="fp32", sparse=True),
                                    gpu_neurons=[hot] + [None] * (model.cfg.num_layers - 1),
                                    predictors=[lambda x: chosen] * model.cfg.num_layers)
    torch.testing.assert_close(executor.forward(0, x), expected, rtol=1e-4, atol=1e-6)
