"""Per-tensor formats in the plan (GGUF blocks kept as they are) and the CPU tier read through the CPU kernels."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from online.execution.gpu_tier import GpuTier
from online.execution.tier_matrix import TierMatrix
from tandem.core.tier_format import TIER_FORMATS, tier_matrix_bytes

from helpers_plans import plan_settings, tiny_plan
from test_gguf_loading import write_tiny_gguf

GGUF_AS_TIER = {"Q8_0": "q8", "Q4_0": "q4", "Q4_1": "q4_1", "F32": "fp32", "F16": "fp16"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny llama GGUF whose tensors cycle through Q4_0, Q4_1, Q8_0, F16, BF16 and F32."""
    path = tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf"
    write_tiny_gguf(path, "llama", seed=3)
    return path


def test_plan_formats_follow_the_checkpoint_and_the_tier_keeps_its_blocks(mixed_gguf, tmp_path):
    from gguf.quants import GGMLQuantizationType, dequantize
    from online import Engine
    from tandem.core.loading import load_checkpoint
    from tandem.core.loading.quants import _as_rows
    from placement.plan import read_plan
    from placement.settings import checkpoint_tensor_formats
    ckpt = load_checkpoint(str(mixed_gguf))
    formats = checkpoint_tensor_formats(ckpt)
    types = ckpt.quant_types
    # independent reading of the rule: every layer's tensor in the format that holds its GGUF type as it is
    # (BF16 in fp16); down rows, re-encoded along the other axis, one step more detailed
    as_tier = {**GGUF_AS_TIER, "BF16": "fp16"}
    finer = {"q4": "q8", "q4_1": "q8", "q8": "fp16", "fp16": "fp16", "fp32": "fp32"}
    settings = plan_settings("int4", formats)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_o": "self_attn.o_proj", "ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj"}
    for role, name in names.items():
        for i in range(2):
            want = as_tier[types[f"model.layers.{i}.{name}.weight"]]
            assert settings.format_of(role, i) == (finer[want] if role == "ffn_down" else want), (role, i)
    assert settings.format_of("output") == as_tier[types["lm_head.weight"]]
    assert settings.format_of("embeddings") == as_tier[types["model.embed_tokens.weight"]]
    assert any(key.startswith("layers.") for key in formats)  # this file's layers differ

    plan_dir = tiny_plan(mixed_gguf, tmp_path, "rtx4090", 1.0, weight_format="int4", tensor_formats=formats)
    plan = read_plan(plan_dir)
    assert dict(plan.settings.tensor_formats) == formats
    engine = Engine.load(str(mixed_gguf), plan=plan_dir, gpu_device="cpu", fused_decode=False)
    tier = engine.executor.tier
    placed = tier.bytes_by_kind()
    for kind in ("ffn_neurons", "attention_and_kv", "output_head", "embeddings"):
        assert placed.get(kind, 0) == plan.gpu_bytes_by_kind[kind], (kind, placed, plan.gpu_bytes_by_kind)
    assert plan.gpu_bytes_by_kind["ffn_neurons"] > 0 and plan.output_head_on_gpu

    def same_blocks(m: TierMatrix, raw) -> bool:  # GGUF blocks kept as they are: decodes as gguf decodes the file
        if GGUF_AS_TIER.get(raw.qtype) != m.fmt or m.fmt in ("fp32", "fp16"):
            return False
        ref = dequantize(_as_rows(raw.data, raw.qtype, raw.shape), GGMLQuantizationType[raw.qtype]).reshape(raw.shape)
        np.testing.assert_array_equal(m.dequantize().numpy(), ref)
        return True

    roles, kept = ("attn_q", "attn_k", "attn_v", "attn_o"), 0
    for i, block in enumerate(engine.model.layers):
        attn = block.self_attn
        assert getattr(attn, "on_tier", False)
        for m, proj, role in zip(attn.qkv_parts + [attn.o], "qkvo", roles):
            assert m.fmt == settings.format_of(role, i)
            kept += same_blocks(m, ckpt.raw[f"model.layers.{i}.self_attn.{proj}_proj.weight"])
    assert kept >= 3  # this file's Q4_0 / Q4_1 / Q8_0 attention tensors, kept as they are
    for i, split in enumerate(engine.executor.splits):
        if split is not None and split.gpu is not None:
            assert (split.gpu.up.fmt, split.gpu.down_t.fmt) == (settings.format_of("ffn_up", i), settings.format_of("ffn_down", i))
    assert engine.executor.tier_head.fmt == formats["output"]
    assert same_blocks(engine.executor.tier_head, ckpt.raw["lm_head.weight"])  # Q8_0 kept as it is
    assert same_blocks(engine.model.embed_tokens.table, ckpt.raw["model.embed_tokens.weight"])  # Q4_0 kept
    assert len(engine.generate([5, 17, 42], max_new_tokens=3).token_ids) == 3


def test_old_plans_keep_their_fingerprint():
    from placement.settings import PlanSettings
    plain = PlanSettings(bytes_per_weight=0.625)
    assert "tensor_formats" not in plain.to_dict()
    mixed = PlanSettings(bytes_per_weight=0.625, tensor_formats={"output": "q8"})
    assert mixed.fingerprint != plain.fingerprint and PlanSettings.from_dict(mixed.to_dict()) == mixed
    assert (mixed.format_of("output"), mixed.format_of("ffn_up")) == ("q8", "q4_1")
    layered = PlanSettings(bytes_per_weight=0.625, tensor_formats={"ffn_up": "q4_1", "layers.1.ffn_up": "q8"})
    assert [layered.format_of("ffn_up", i) for i in range(3)] == ["q4_1", "q8", "q4_1"]
    assert mixed.bytes_of("output") == TIER_FORMATS["q8"]


@pytest.mark.parametrize("bad", [{"output": "q3"}, {"lm_head": "q8"}, "q8", {"layers.1.output": "q8"},
                                 {"layers.x.ffn_up": "q8"}])
def test_bad_tensor_formats_are_refused(bad):
    from placement.settings import PlanSettings
    from tandem.core.errors import TandemError
    with pytest.raises(TandemError):
        PlanSettings(bytes_per_weight=0.625, tensor_formats=bad)


@pytest.mark.parametrize("fmt", list(TIER_FORMATS))
def test_cpu_tier_reads_its_codes_through_the_kernels(fmt, monkeypatch):
    """A CPU tier multiplies through the CPU kernels over the same codes: no dequantization per call."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 96, generator=g)  # [R, C]
    tier = GpuTier.create(1 << 20, "cpu", threads=1)
    m = TierMatrix.pack(w, fmt, tier, "layers.0.hot_up")
    assert m.nbytes == tier.used_bytes == tier_matrix_bytes(40, 96, fmt)
    reference = m.dequantize()  # [R, C], what the torch path (CUDA) multiplies by
    x = torch.randn(2, 96, generator=g)
    monkeypatch.setattr(TierMatrix, "dequantize", lambda self: pytest.fail("dequantized per call"))
    assert m.kernel() is not None
    y = m.linear(x[:1])
    torch.testing.assert_close(y, x[:1] @ reference.T, rtol=1e-4, atol=1e-4)
    ids = torch.tensor([3, 0, 39])
    if fmt not in ("fp32", "fp16"):
        torch.testing.assert_close(m.take_rows(ids), reference[ids], rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["q8", "q4", "q4_1", "fp16"])
def test_hot_rows_on_the_cpu_tier_equal_the_torch_path(fmt):
    """The hot FFN part through the CPU kernels equals dequantize + matmul of the same tier codes."""
    from tandem.core.config import ModelConfig
    from online.execution.hybrid import ExecutionSettings, HybridExecutor
    from tandem.core.ffn.weights import FFNWeights
    d, n_ff = 64, 96
    g = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=d, intermediate_size=n_ff, num_layers=1,
                      num_heads=4, num_kv_heads=4, head_dim=16, hidden_act="silu", mlp_gated=True)
    w = FFNWeights(up=r(n_ff, d), down=r(d, n_ff), gate=r(n_ff, d))
    tier = GpuTier.create(1 << 20, "cpu", threads=1)
    settings = ExecutionSettings(tier_format="q8", tier_formats=(("ffn_up", fmt), ("ffn_gate", fmt)), sparse=False)
    ex = HybridExecutor.build(cfg, [w], tier, settings, gpu_neurons=[torch.arange(0, n_ff, 2)])
    part = ex.splits[0].gpu
    assert part.kernel_ffn is not None and part.up.fmt == fmt and part.down_t.fmt == "q8"
    x = r(1, d)
    y_kernel = ex._gpu_forward(part, x)
    part.kernel_ffn = None  # the torch path over the same codes
    torch.testing.assert_close(y_kernel, ex._gpu_forward(part, x), rtol=1e-4, atol=1e-4)


def test_plan_bytes_for_predictors_on_the_tier(tiny_model_dir, tmp_path):
    """A plan that puts predictors on the GPU: the tier holds their bytes, as planned, under ``predictors``."""
    from offline.profile_artifact import load_profile
    from online import Engine
    from tandem.core.loading import load_checkpoint
    from placement.hardware import load_hardware
    from placement.plan import save_plan
    from placement.planner import make_plan
    from placement.predictor_info import load_predictor_info
    from predictors.artifact import save_predictors
    from predictors.model import PredictorSet
    from helpers_plans import RESERVE_BYTES, full_model_bytes, plan_settings, tiny_profile
    folder, _ = tiny_model_dir("llama")
    ckpt = load_checkpoint(str(folder))
    cfg = ckpt.config
    profile_dir = tiny_profile(folder, tmp_path)
    profile = load_profile(profile_dir)
    pred_dir = tmp_path / "predictors"
    save_predictors(PredictorSet(_entries(cfg), meta={"model_fingerprint": ckpt.fingerprint, "profile_fingerprint":
                                                      profile.fingerprint, "model_id": ckpt.model_id,
                                                      "model_param_count": 10_000}), pred_dir)
    info = load_predictor_info(pred_dir, cfg.num_layers, ckpt.fingerprint, profile.fingerprint)
    budget = RESERVE_BYTES + int(0.3 * full_model_bytes(folder, profile_dir))
    # a slow host and a cheap sync: splitting a layer pays
    hardware = dataclasses.replace(load_hardware("rtx4090"), cpu_bandwidth_bytes_per_s=2e8, layer_sync_latency_s=1e-7)
    plan = make_plan(cfg, model_fingerprint=ckpt.fingerprint, model_id=ckpt.model_id, profile=profile,
                     hardware=hardware, gpu_budget_bytes=budget, predictors=info,
                     settings=dataclasses.replace(plan_settings(), min_gpu_neurons_per_layer=16))
    # the planner places no predictor (the runtime scores cold rows on the host, so one on the GPU saves no time);
    # a plan that does (made before, or by hand) puts the split layers' predictors there
    assert not any(layer["predictor_on_gpu"] for layer in plan.layers) and plan.gpu_bytes_by_kind["predictors"] == 0
    split = [i for i, layer in enumerate(plan.layers) if layer["gpu_neurons"] or layer["attention_on_gpu"]]
    assert split
    kinds = dict(plan.gpu_bytes_by_kind, predictors=sum(info.layers[i].param_bytes for i in split))
    plan = dataclasses.replace(plan, layers=[dict(layer, predictor_on_gpu=i in split) for i, layer in enumerate(plan.layers)],
                               gpu_bytes_by_kind=kinds, gpu_budget_bytes=budget + kinds["predictors"])
    plan_dir = save_plan(plan, tmp_path / "plan")
    engine = Engine.load(str(folder), plan=plan_dir, gpu_device="cpu", predictors=pred_dir, fused_decode=False)
    placed = engine.executor.tier.bytes_by_kind()
    for kind in ("predictors", "ffn_neurons", "attention_and_kv", "output_head", "embeddings"):
        assert placed.get(kind, 0) == plan.gpu_bytes_by_kind[kind], (kind, placed, plan.gpu_bytes_by_kind)
    assert len(engine.generate([5, 17, 42], max_new_tokens=3).token_ids) == 3


def _entries(cfg) -> list:
    from predictors.model import LayerEntry, LayerPredictor
    torch.manual_seed(5)
    stats = {"recall": 0.97, "predicted_sparsity": 0.5}
    return [LayerEntry("predictor", LayerPredictor(cfg.hidden_size, 8, cfg.intermediate_size).eval().requires_grad_(False),
                       threshold=0.0, stats=stats) for _ in range(cfg.num_layers)]


def test_tier_predictors_give_the_host_predictors_rows_in_one_exchange_per_layer(tiny_model_dir):
    """Predictors on the tier select the same rows as on the host (same logits), and ride in the layer's
    one exchange: with its tier attention (layer 0) or with its hot rows (layer 1)."""
    from online.execution.hybrid import ExecutionSettings, HybridExecutor
    from online.execution.tier_units import TierPredictor, place_plan_units, place_predictors
    from tandem.core.generate import prefill
    from tandem.core.kv_cache import KVCache
    from tandem.core.loading.hf_loader import load_hf_folder
    from tandem.core.model.build import build_model
    from predictors.model import PredictorSet
    from predictors.runtime import LayerGate
    folder, _ = tiny_model_dir("llama")
    ids = [5, 17, 42, 9, 77, 3]

    def run(on_tier: bool):
        model, ffn = build_model(load_hf_folder(folder))
        cfg = model.cfg
        gates = [LayerGate(PredictorSet(_entries(cfg)), i) for i in range(cfg.num_layers)]
        tier = GpuTier.create(1 << 24, "cpu", threads=1)
        hot = [torch.arange(0, cfg.intermediate_size, 3)] * cfg.num_layers
        ex = HybridExecutor.build(cfg, ffn, tier, ExecutionSettings(weight_format="fp32", threads=1),
                                  gpu_neurons=hot, predictors=gates, head_weight=model.lm_head.weight)
        if on_tier:
            place_predictors(ex, tier, gates, [True] * cfg.num_layers)
            assert all(isinstance(s.predictor, TierPredictor) for s in ex.splits)
        place_plan_units(model, ex, tier, attention_on_gpu=[True] + [False] * (cfg.num_layers - 1),
                         output_head_on_gpu=False, embeddings_on_gpu=False, tier_format="fp32",
                         kv_dtype=torch.float32, kv_capacity_tokens=16)
        cache = KVCache(cfg, 64)
        out = [prefill(model, ex, cache, ids[:3], all_logits=True)]
        syncs = []
        for pos in range(3, len(ids)):
            before = tier.exchanges
            out.append(model(torch.tensor([ids[pos]]), pos, cache, ex))
            syncs.append(tier.exchanges - before)
        return torch.cat(out), syncs, tier
    ref, ref_syncs, _ = run(False)
    got, syncs, tier = run(True)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert syncs == ref_syncs == [2] * 3  # layer 0: attention + hot rows (+ mask); layer 1: hot rows (+ mask)
    assert tier.bytes_by_kind()["predictors"] == 4 * sum(p.numel() for e in _entries(model_cfg(folder))
                                                         for p in e.predictor.parameters())


def model_cfg(folder):
    from tandem.core.loading.hf_loader import load_hf_folder
    return load_hf_folder(folder).config


@pytest.mark.parametrize("fmt", ["fp32", "q8"])
def test_shared_expert_on_the_tier_equals_the_dense_one(fmt):
    """Qwen2-MoE's shared expert on the tier computes what ``dense.shared_expert_out`` does (fp32: to rounding;
    q8: to its quantization), in one exchange, with the bytes the planner counts."""
    from tandem.core.config import ModelConfig
    from tandem.core.ffn.dense import shared_expert_out
    from online.execution.tier_units import place_shared_experts
    from tandem.core.ffn.weights import FFNWeights, MoELayerWeights
    d, width = 64, 96
    g = torch.Generator().manual_seed(8)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    cfg = ModelConfig(arch="qwen2_moe", vocab_size=32, hidden_size=d, intermediate_size=width, num_layers=2,
                      num_heads=4, num_kv_heads=4, head_dim=16, hidden_act="silu", mlp_gated=True,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=width)
    moe = MoELayerWeights(router=r(4, d), experts=[], shared_expert=FFNWeights(up=r(width, d), down=r(d, width), gate=r(width, d)),
                          shared_expert_gate=r(1, d))
    tier = GpuTier.create(1 << 22, "cpu", threads=1)
    placed = place_shared_experts(cfg, [None, moe], tier, [False, True], fmt)
    assert list(placed) == [1]
    assert tier.bytes_by_kind() == {"shared_experts": 2 * tier_matrix_bytes(width, d, fmt)
                                    + tier_matrix_bytes(d, width, fmt) + 4 * d}
    x = r(3, d)
    before = tier.exchanges
    y = placed[1](x)
    assert tier.exchanges - before == 1
    tolerance = {"fp32": 1e-5, "q8": 2e-2}[fmt]
    torch.testing.assert_close(y, shared_expert_out(cfg, moe, x), rtol=tolerance, atol=tolerance)
