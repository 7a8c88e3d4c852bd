"""Per-tensor formats in the plan (GGUF blocks kept as they are) and the CPU tier read through the CPU kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from online.execution.gpu_tier import GpuTier
from online.execution.tier_format import TIER_FORMATS, TierMatrix, tier_matrix_bytes

from helpers_plans import tiny_plan
from test_gguf_loading import write_tiny_gguf

GGUF_AS_TIER = {"Q8_0": "q8", "Q4_0": "q4", "Q4_1": "q4_1", "F32": "fp32", "F16": "fp16"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny llama GGUF whose tensors cycle through Q4_0, Q4_1, Q8_0, F16, BF16 and F32."""
    path = tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf"
    write_tiny_gguf(path, "llama", seed=3)
    return path


def test_plan_formats_follow_the_checkpoint_and_the_tier_keeps_its_blocks(mixed_gguf, tmp_path):
    from gguf.quants import GGMLQuantizationType, dequantize
    from online import Engine
    from online.loading import load_checkpoint
    from online.loading.quants import _as_rows
    from placement.plan import read_plan
    from placement.settings import checkpoint_tensor_formats
    ckpt = load_checkpoint(str(mixed_gguf))
    formats = checkpoint_tensor_formats(ckpt)
    types = ckpt.quant_types
    # independent reading of the rule: the most detailed type of the role's tensors, as the tier holds it
    rank = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "F16": 3, "BF16": 3, "F32": 4}
    best = max((types[f"model.layers.{i}.mlp.up_proj.weight"] for i in range(2)), key=rank.get)
    assert formats["ffn_up"] == {"BF16": "fp16"}.get(best, GGUF_AS_TIER.get(best))
    assert formats["output"] == {"BF16": "fp16"}.get(types["lm_head.weight"], GGUF_AS_TIER.get(types["lm_head.weight"]))
    assert len(set(formats.values())) >= 3  # the roles really differ in this file

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

    roles = ("attn_q", "attn_k", "attn_v", "attn_o")
    for i, block in enumerate(engine.model.layers):
        attn = block.self_attn
        assert getattr(attn, "on_tier", False)
        for m, proj, role in zip(attn.qkv_parts + [attn.o], "qkvo", roles):
            assert m.fmt == formats[role]
            same_blocks(m, ckpt.raw[f"model.layers.{i}.self_attn.{proj}_proj.weight"])
    split = next(s for s in engine.executor.splits if s is not None and s.gpu is not None)
    assert split.gpu.up.fmt == formats["ffn_up"] and split.gpu.down_t.fmt == formats["ffn_down"]
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
    assert mixed.bytes_of("output") == TIER_FORMATS["q8"]


@pytest.mark.parametrize("bad", [{"output": "q3"}, {"lm_head": "q8"}, "q8"])
def test_bad_tensor_formats_are_refused(bad):
    from placement.settings import PlanSettings
    from tandem.errors import TandemError
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
    from online.config import ModelConfig
    from online.execution.hybrid import ExecutionSettings, HybridExecutor
    from online.execution.weights import FFNWeights
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
