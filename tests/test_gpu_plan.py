"""Plans on the GPU tier (run on the CPU here): formats, bytes the plan names, every preset loads."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from online import Engine
from online.execution.gpu_tier import GpuTier
from online.execution.tier_matrix import TierMatrix
from tandem.core.tier_format import TIER_FORMATS, tier_format_for
from placement.plan import read_plan

from helpers_plans import tier_units_model, tiny_plan

# every kind the runtime places (predictors: tests/test_tier_formats.py)
PLACED_KINDS = ("ffn_neurons", "experts", "attention_and_kv", "output_head", "embeddings", "shared_experts")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("fmt,qtype", [("q8", "Q8_0"), ("q4", "Q4_0"), ("q4_1", "Q4_1")])
def test_tier_blocks_dequantize_as_gguf_does(fmt, qtype):
    """The tier's packed rows, rewritten as GGUF blocks, dequantize identically with gguf's own dequantizer."""
    from gguf.quants import GGMLQuantizationType, dequantize
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))  # [R, C]
    tier = GpuTier.create(1 << 20, "cpu")
    m = TierMatrix.pack(w, fmt, tier, "layers.0.hot_up")
    assert m.nbytes == tier.used_bytes == int(6 * 96 * TIER_FORMATS[fmt])
    scale = m.scale.numpy().view(np.uint8).reshape(6, 3, 2)  # [R, blocks, 2] f16 bytes
    codes = m.data.numpy().view(np.uint8).reshape(6, 3, -1)  # [R, blocks, 32 or 16]
    head = [scale] if m.minimum is None else [scale, m.minimum.numpy().view(np.uint8).reshape(6, 3, 2)]
    raw = np.concatenate(head + [codes], axis=-1).reshape(6, -1)
    ref = dequantize(raw, GGMLQuantizationType[qtype])  # [6, 96]
    np.testing.assert_array_equal(m.dequantize().numpy(), ref)
    tolerance = {"q8": 0.01, "q4": 0.2, "q4_1": 0.2}[fmt]
    assert (m.dequantize() - w).abs().max() <= tolerance * w.abs().max()
    x = torch.randn(3, 96)
    torch.testing.assert_close(m.linear(x), x @ torch.from_numpy(ref).T, rtol=1e-5, atol=1e-5)


def test_tier_format_follows_the_plans_bytes_per_weight():
    assert [tier_format_for(b) for b in (4.0, 2.0, 1.0625, 0.625, 0.5625, 3.0)] == ["fp32", "fp16", "q8", "q4_1", "q4", "fp16"]


@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral", "qwen2_moe"])
def test_runtime_tier_bytes_equal_the_plan(tiny_model_dir, tmp_path_factory, kind):
    """At 0/10/50/100% of the model's bytes the tier holds, by kind, what plan.json says (within the reserve)."""
    folder, _ = tiny_model_dir(kind)
    out = tmp_path_factory.mktemp(f"plans-{kind}")
    for fraction in (0.0, 0.1, 0.5, 1.0):
        plan_dir = tiny_plan(folder, out, "rtx4090", fraction)
        plan = read_plan(plan_dir)
        engine = Engine.load(str(folder), plan=plan_dir, gpu_device="cpu", fused_decode=False)
        tier = engine.executor.tier
        runtime = tier.bytes_by_kind()
        assert tier.used_bytes <= plan.gpu_budget_bytes
        for key in PLACED_KINDS:
            assert runtime.get(key, 0) == plan.gpu_bytes_by_kind[key], (fraction, key, runtime, plan.gpu_bytes_by_kind)
        if fraction == 1.0 and not engine.config.is_moe:
            assert plan.gpu_bytes_by_kind["ffn_neurons"] > 0
        if fraction == 1.0 and engine.config.shared_expert_intermediate_size:
            assert plan.gpu_bytes_by_kind["shared_experts"] > 0


@pytest.mark.parametrize("hardware", ["rtx4090", "rtx2080ti", "t4", "h100"])
def test_every_preset_plan_loads_and_generates_on_the_cpu_tier(tiny_model_dir, tmp_path_factory, hardware):
    folder, _ = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp(f"preset-{hardware}")
    for fraction, fmt in ((0.25, "int4"), (0.4, 0.625), (0.6, "int8"), (1.0, "fp16")):  # 0.625: Q4_1 checkpoints
        plan_dir = tiny_plan(folder, out, hardware, fraction, weight_format=fmt)
        engine = Engine.load(str(folder), plan=plan_dir, gpu_device="cpu")
        result = engine.generate([5, 17, 42], max_new_tokens=4)
        assert len(result.token_ids) == 4
        plan = read_plan(plan_dir)
        assert engine.executor.tier.used_bytes <= plan.gpu_budget_bytes
        placed = engine.executor.tier.bytes_by_kind()
        assert all(placed.get(k, 0) == plan.gpu_bytes_by_kind[k] for k in PLACED_KINDS), (fmt, placed, plan.gpu_bytes_by_kind)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_planned_expert_slot_bytes_equal_the_packed_expert(fmt, gated, bias):
    from tandem.core.config import ModelConfig
    from tandem.core.tier_format import expert_layout_bytes
    from tandem.core.ffn.weights import FFNWeights
    from online.experts.packing import pack_expert
    d, n_ff = 64, 48
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    w = FFNWeights(up=r(n_ff, d), down=r(d, n_ff), gate=r(n_ff, d) if gated else None,
                   up_bias=r(n_ff) if bias else None, gate_bias=r(n_ff) if bias and gated else None,
                   down_bias=r(d) if bias else None)
    cfg = ModelConfig(arch="llama" if gated else "opt", vocab_size=32, hidden_size=d, intermediate_size=n_ff,
                      num_layers=1, num_heads=4, num_kv_heads=4, head_dim=16,
                      hidden_act="silu" if gated else "relu", mlp_gated=gated, mlp_bias=bias)
    assert expert_layout_bytes(d, n_ff, gated, fmt, bias=bias) == pack_expert(cfg, w, fmt).nbytes


@pytest.mark.parametrize("kind", ["llama", "opt", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("attention,head,embeddings", [((True, False), False, True), ((False, True), True, False),
                                                        ((True, True), True, True)])
def test_tier_units_equal_dense(tiny_model_dir, kind, attention, head, embeddings):
    """fp32 tier, all neurons active: attention + KV, output layer and embeddings on the tier change nothing."""
    from tandem.core.ffn import DenseExecutor
    from tandem.core.generate import prefill
    from tandem.core.kv_cache import KVCache
    from tandem.core.loading.hf_loader import load_hf_folder
    from tandem.core.model.build import build_model
    folder, _ = tiny_model_dir(kind)
    ids = [5, 17, 42, 9, 77, 3, 101]

    def run(model, executor):  # prefill 4 tokens, then 3 single-token decode steps
        cache = KVCache(model.cfg, 64)
        out = [prefill(model, executor, cache, ids[:4], all_logits=True)]
        for pos in range(4, len(ids)):
            out.append(model(torch.tensor([ids[pos]]), pos, cache, executor))
        return torch.cat(out)
    model, ffn = build_model(load_hf_folder(folder))
    ref = run(model, DenseExecutor(model.cfg, ffn))
    model, executor, tier = tier_units_model(folder, attention, head, embeddings)
    kinds = tier.bytes_by_kind()
    assert (kinds.get("attention_and_kv", 0) > 0) == any(attention) and (kinds.get("output_head", 0) > 0) == head
    torch.testing.assert_close(run(model, executor), ref, rtol=1e-4, atol=1e-5)


def test_stats_count_one_exchange_per_layer_on_the_tier(tiny_model_dir, tmp_path_factory):
    """Per token: one send + one fetch (a sync on CUDA) per layer that uses the tier (attention, hot rows or
    both: then one exchange for both), per output layer and embeddings on it, and the bytes they move."""
    folder, _ = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp("link")
    for fraction in (0.5, 1.0):
        plan_dir = tiny_plan(folder, out, "rtx4090", fraction)
        plan = read_plan(plan_dir)
        engine = Engine.load(str(folder), plan=plan_dir, gpu_device="cpu")
        stats = engine.generate([5, 17, 42], max_new_tokens=5, ignore_eos=True).stats
        hot = [plan.gpu_neurons(i).numel() > 0 for i in range(plan.num_layers)]
        both = sum(a and h for a, h in zip(plan.attention_on_gpu, hot))
        one = sum(a != h for a, h in zip(plan.attention_on_gpu, hot))
        tied = engine.config.tie_word_embeddings
        units = both + one + plan.output_head_on_gpu + (plan.output_head_on_gpu if tied else plan.embeddings_on_gpu)
        assert stats["tier_syncs_per_token"] == stats["tier_calls_per_token"] == units
        d, vocab = engine.config.hidden_size, engine.config.vocab_size
        # a layer sends d floats and fetches d (one unit) or 2d (attention output and hot FFN output together)
        per_decode_token = 4 * (both * 3 * d + one * 2 * d + plan.output_head_on_gpu * (d + vocab)) \
            + 4 * d * plan.embeddings_on_gpu + 8 * plan.embeddings_on_gpu
        assert units > 0 and stats["link_bytes_per_token"] >= per_decode_token
        if fraction == 1.0:
            assert both > 0  # the fused exchange was exercised


def test_plan_quality_is_measured_recorded_shown_and_warned(tiny_model_dir, tmp_path, capsys):
    """Dense perplexity against transformers on the same tokens; the record round-trips, prints, warns."""
    import math
    from placement.cli import format_plan_summary
    from placement.plan import save_plan
    from online.plan_measure import measure_plan_quality
    folder, hf_model = tiny_model_dir("llama")
    plan_dir = tiny_plan(folder, tmp_path, "rtx4090", 0.5)
    docs = [torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    q = measure_plan_quality(folder, plan_dir, max_tokens=100, gpu_device="cpu", token_docs=docs, max_quality_loss=0.5)
    tokens = (docs[0] + docs[1])[:100]
    window = q["window_tokens"]  # non-overlapping windows of the plan's context
    with torch.no_grad():
        parts = [hf_model(torch.tensor([tokens[b:b + window + 1]])).logits[0, :-1] for b in range(0, 99, window)]
    nll = torch.nn.functional.cross_entropy(torch.cat(parts).double(), torch.tensor(tokens[1:]))
    assert q["held_out_tokens"] == 99 and abs(q["dense_perplexity"] - math.exp(float(nll))) < 1e-3 * q["dense_perplexity"]
    assert 0.0 <= q["greedy_agreement"] <= 1.0 and q["perplexity"] > 0
    plan = read_plan(plan_dir)
    plan.quality = dict(q, perplexity_increase=0.9)  # outside its 50% budget
    save_plan(plan, plan_dir)
    assert read_plan(plan_dir).quality["perplexity_increase"] == 0.9
    assert "greedy agreement" in format_plan_summary(read_plan(plan_dir))
    capsys.readouterr()
    Engine.load(str(folder), plan=plan_dir, gpu_device="cpu")
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "above dense" in err and err.count("\n") == 1
    plan.quality = dict(q, perplexity_increase=0.1)
    save_plan(plan, plan_dir)
    Engine.load(str(folder), plan=plan_dir, gpu_device="cpu")
    assert "warning" not in capsys.readouterr().err
