"""--layer-offload: llama.cpp's -ngl policy on the tier + the C step over the CPU layer range."""
from __future__ import annotations

import pytest
import torch

from online.engine import Engine
from online.execution.layer_offload import gpu_layer_count, layer_tier_bytes
from tandem.core.errors import TandemError

PROMPT = [5, 17, 42, 9, 77, 3]


def _layer_bytes(engine, fmt):
    return layer_tier_bytes(engine.config, fmt, torch.float16, engine.max_context)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_range_step_with_no_gpu_layers_is_the_whole_model_step(tiny_model_dir, kind):
    folder, _ = tiny_model_dir(kind)
    offload = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=0)
    fused = Engine.load(folder, weight_format="int8")
    assert offload.layer_offload_gpu_layers == 0 and offload.decode_path == "layer-offload"
    torch.testing.assert_close(offload.step_logits(PROMPT), fused.step_logits(PROMPT), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tier_layers_plus_c_range_match_the_module_path(tiny_model_dir, kind):
    """1 of 2 layers on the tier: the tier layer (torch) + one C call equals the same engine's modules."""
    folder, _ = tiny_model_dir(kind)
    probe = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=0)
    budget = _layer_bytes(probe, "q8") + 100
    engine = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=budget)
    modules = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=budget, fused_decode=False)
    assert engine.layer_offload_gpu_layers == 1 and engine.decode_path == "layer-offload"
    assert engine.executor.tier.used_bytes == _layer_bytes(engine, "q8")  # the -ngl arithmetic is what is placed
    torch.testing.assert_close(engine.step_logits(PROMPT), modules.step_logits(PROMPT), rtol=0.02, atol=0.02)
    a = engine.generate(PROMPT, max_new_tokens=5, ignore_eos=True)
    assert len(a.token_ids) == 5 and a.stats["tier_syncs_per_token"] == 1  # attention + FFN of the tier layer: one exchange


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_float32_layer_offload_equals_the_all_cpu_dense_output(tiny_model_dir, kind):
    folder, _ = tiny_model_dir(kind)
    dense = Engine.load(folder)
    for n_layers in (1, 2):
        probe = Engine.load(folder, weight_format="fp32", layer_offload=True, gpu_budget_bytes=0)
        budget = n_layers * _layer_bytes(probe, "fp32")
        engine = Engine.load(folder, weight_format="fp32", layer_offload=True, gpu_budget_bytes=budget)
        assert engine.layer_offload_gpu_layers == n_layers
        torch.testing.assert_close(engine.logits(PROMPT), dense.logits(PROMPT), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(engine.step_logits(PROMPT), dense.step_logits(PROMPT), rtol=1e-3, atol=1e-3)


def test_gpu_layer_count_follows_the_budget(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    cfg = Engine.load(folder).config
    per = layer_tier_bytes(cfg, "q4", torch.float16, 128)
    assert [gpu_layer_count(cfg, b, "q4", torch.float16, 128) for b in (0, per - 1, per, 2 * per, 10 * per)] == [0, 0, 1, 2, 2]


def test_layer_offload_errors(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(TandemError, match="needs gpu_budget_bytes"):
        Engine.load(folder, layer_offload=True)
    with pytest.raises(TandemError, match="MoE"):
        Engine.load(tiny_model_dir("mixtral")[0], layer_offload=True, gpu_budget_bytes=1 << 20)
