"""OPT (LayerNorm with bias, learned positions, biases everywhere, plain ReLU FFN) and MoE layers (Mixtral:
top-k of the softmax, renormalised; Qwen2-MoE: shared expert with a sigmoid gate) in the fused C step:
against the module path on the same packed weights, transformers, and its own multi-token step (bit for
bit); and every CPU plan kind decodes through the fused step."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_hf_model
from online.execution.fused_decode import FusedDecodeStep
from online.execution.gpu_tier import GpuTier
from online.execution.hybrid import ExecutionSettings, HybridExecutor
from online.execution.quantized_linear import quantize_attention
from tandem.core.loading.hf_loader import load_hf_folder
from tandem.core.model.build import build_model
from test_fused_decode import PROMPT
from test_fused_new_archs import _module_and_fused, engine_fused_close_to_transformers
from test_fused_predict import random_gates
from test_multi_token_step import CHUNKS, _singles_and_many

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KINDS = ["opt", "mixtral", "qwen2_moe"]
DECODE = [3, 99, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """kind -> (folder, transformers model) with random biases and norms (the defaults, zeros and ones,
    would hide a missing bias or a wrong norm)."""
    made = {}

    def make(kind: str):
        if kind not in made:
            model = tiny_hf_model(kind).eval()
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias") or "norm" in name.lower():
                        p.add_(torch.randn(p.shape, generator=g) * 0.2)
            folder = tmp_path_factory.mktemp(f"perturbed-{kind}")
            model.save_pretrained(folder)
            made[kind] = (folder, model)
        return made[kind]
    return make


def packed(folder, fmt="int8", thresholds=None, predictors=None, expert_format=None):
    """The module path's model and packed executor; ``expert_format``: MoE experts from an ExpertRuntime
    (packed host buffers on a CPU tier) instead of the float MoE weights."""
    model, ffn_layers = build_model(load_hf_folder(folder))
    settings = ExecutionSettings(weight_format=fmt, sparse=thresholds is not None)
    executor = HybridExecutor.build(model.cfg, ffn_layers, GpuTier.create(0, "cpu"), settings, thresholds=thresholds,
                                    predictors=predictors, head_weight=model.lm_head.weight)
    if expert_format is not None:
        from online.experts.runtime import ExpertRuntime
        executor.attach_experts(ExpertRuntime(model.cfg, ffn_layers, GpuTier.create(0, "cpu"),
                                              weight_format=expert_format, slots=0, prefetch=False))
    quantize_attention(model, fmt, settings.threads)
    return model, executor


def module_and_fused(model, executor, step, tokens=DECODE):
    """([T, vocab] module path, [T, vocab] fused, neurons per token of each) after the same prefill."""
    return _module_and_fused(model, executor, step, tokens)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fused_step_matches_the_module_path(perturbed, kind, fmt):
    """15-bit activations (residual_ratio 0): the C step is the module path's arithmetic within float noise
    (LayerNorm and its bias, learned positions, fc1/fc2 biases; router, top-k, experts, shared expert)."""
    model, executor = packed(perturbed(kind)[0], fmt)
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    ref, ours, n_ref, n_ours = module_and_fused(model, executor, step)
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=2e-3)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    cfg = model.cfg  # dense: every neuron of the layer / of the selected and shared experts
    per_layer = (cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
                 if cfg.is_moe else cfg.intermediate_size)
    assert n_ours == [cfg.num_layers * per_layer] * len(DECODE)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("expert_format", ["int8", "int4", "fp32"])
def test_experts_read_from_the_expert_runtime(perturbed, kind, expert_format):
    """A plan's MoE layers hold their experts in an ExpertRuntime (packed host buffers): the C step reads
    those rows in place and matches the runtime's CPU computation."""
    model, executor = packed(perturbed(kind)[0], "int8", expert_format=expert_format)
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    ref, ours, n_ref, n_ours = module_and_fused(model, executor, step, DECODE[:4])
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=2e-3)
    assert n_ours == n_ref


def test_opt_relu_rows_are_sparse_like_the_module_path(perturbed):
    """OPT's plain ReLU FFN at threshold 0: only the rows with h > 0 are added, as the module path's sparse FFN."""
    model, executor = packed(perturbed("opt")[0], "int8", thresholds=[0.0, 0.0])
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    ref, ours, n_ref, n_ours = module_and_fused(model, executor, step)
    total = model.cfg.num_layers * model.cfg.intermediate_size
    assert all(0 < n < total for n in n_ref)
    assert all(abs(a - b) <= 2 for a, b in zip(n_ref, n_ours))  # a neuron at zero may flip
    torch.testing.assert_close(ours, ref, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_opt_predicted_rows_match_the_module_path(perturbed, fmt):
    """OPT with a predictor: the same predicted fc1 rows (plus their bias), the same logits."""
    cfg = load_hf_folder(perturbed("opt")[0]).config
    gates = random_gates(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers)
    model, executor = packed(perturbed("opt")[0], fmt, thresholds=[0.0, 0.0], predictors=gates)
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0, predictor_format="fp32")
    ref, ours, n_ref, n_ours = module_and_fused(model, executor, step)
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=2e-3)
    assert all(abs(a - b) <= 1 for a, b in zip(n_ref, n_ours))
    predicted, computed = step.predictor_rows()
    assert 0 < computed <= predicted < len(DECODE) * cfg.num_layers * cfg.intermediate_size


@pytest.mark.parametrize("kind", KINDS)
def test_engine_decodes_fused_close_to_transformers(perturbed, kind):
    engine_fused_close_to_transformers(*perturbed(kind))


@pytest.mark.parametrize("kind,thresholds", [("opt", [0.0, 0.0]), ("opt", None), ("mixtral", None),
                                             ("qwen2_moe", [0.02, 0.02])])
def test_step_many_equals_single_steps(perturbed, kind, thresholds):
    """Bit for bit: logits, KV rows and neuron counts (MoE tokens of one call choose different experts)."""
    model, executor = packed(perturbed(kind)[0], "int4", thresholds=thresholds,
                             expert_format="int4" if kind == "qwen2_moe" else None)
    step = FusedDecodeStep.build(model, executor)
    _singles_and_many(step, executor, model.cfg, PROMPT, CHUNKS)


@pytest.mark.parametrize("kind", ["llama", "llama-relu", "opt", "mixtral", "qwen2_moe"])
def test_every_cpu_plan_kind_decodes_fused(tiny_model_dir, tmp_path, kind):
    """cpu-only plans: dense SiLU, exact-zero ReLU, OPT, MoE (experts in an ExpertRuntime on the CPU tier).
    Plans with predictors: test_synth's README pipeline (profile, train-predictors, plan, generate)."""
    from helpers_plans import tiny_plan
    from online.engine import Engine
    folder, _ = tiny_model_dir(kind)
    plan_dir = tiny_plan(folder, tmp_path, "cpu-only", 0)
    engine = Engine.load(folder, plan=str(plan_dir))
    assert engine.decode_path == "fused", engine.decode_path_reason
    out = engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True)
    assert out.stats["decode_path"] == "fused" and len(out.token_ids) == 3
    modules = Engine.load(folder, plan=str(plan_dir), fused_decode=False)
    assert modules.generate(PROMPT, max_new_tokens=3, ignore_eos=True).token_ids[:2] == out.token_ids[:2]


def test_experts_cached_on_a_gpu_tier_keep_the_module_path(perturbed):
    """The fused step reads every expert from RAM; a CUDA expert cache stays with the module path."""
    from types import SimpleNamespace
    from online.execution.fused_decode import FusedDecodeUnavailable
    model, executor = packed(perturbed("mixtral")[0], "int8", expert_format="int8")
    executor.experts.tier = SimpleNamespace(is_cuda=True)
    with pytest.raises(FusedDecodeUnavailable, match="GPU tier"):
        FusedDecodeStep.build(model, executor)
