"""The GPU step's program (online/gpu) for plans at 0..100% of a model's bytes, run eagerly on the CPU
tier with the torch ops: each decode token equals the module path's (the reference the tier units
already match), with one exchange per layer that has a cold part and one group per token when
everything is on the tier."""
from __future__ import annotations

import pytest
import torch

from online import Engine
from online.gpu.stack import GpuStepUnavailable
from tandem.core.errors import TandemError

from helpers_plans import tier_units_model, tiny_plan

PROMPT = [5, 17, 42, 9, 77, 3, 11, 2, 60, 8, 31, 99]  # 12 tokens: past the tiny Gemma 3's 8-token window

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_gpu_program_equals_the_module_path_at_every_split(tiny_model_dir, tmp_path_factory, kind):
    folder, _ = tiny_model_dir(kind)
    out = tmp_path_factory.mktemp(f"gpu-step-{kind}")
    seen_groups = {}
    for fraction in (0.1, 0.5, 1.0):
        plan_dir = tiny_plan(folder, out, "rtx4090", fraction)
        modules = Engine.load(str(folder), plan=plan_dir, gpu_device="cpu", fused_decode=False)
        engine = Engine.load(str(folder), plan=plan_dir, gpu_device="cpu", fused_decode=False)
        assert engine.use_gpu_step(backend="torch"), engine.decode_path_reason
        assert engine.decode_path == "gpu-step"
        want = modules.step_logits(PROMPT)
        tier = engine.executor.tier
        syncs = tier.exchanges
        got = engine.step_logits(PROMPT)  # every token through the step: its own exchanges only
        syncs_per_token = (tier.exchanges - syncs) / len(PROMPT)
        # whole CPU layers run through the fused C step (int8 activations, as test_layer_offload allows; Gemma 3's
        # sandwich norms scale that error up: up to 0.11 of its softcapped +-3 logits, as the fused CPU step shows
        # too; the tight check of its GPU program is the dense test below)
        tol = 1.5e-1 if kind == "gemma3" else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert float((got - want).abs().mean()) < tol / 5
        step = engine.compiled_decode
        seen_groups[fraction] = step.graphs_per_token
        result = engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
        if kind != "gemma3":  # (its tiny random model's near-flat softcapped logits flip under that 0.075)
            assert result.token_ids == modules.generate(PROMPT, max_new_tokens=4, ignore_eos=True).token_ids
        cold_layers = sum(1 for s in engine.executor.splits if s.cpu is not None)
        host_attention = sum(1 for b in engine.model.layers if not getattr(b.self_attn, "on_tier", False))
        head_on_host = engine.executor.tier_head is None
        # syncs: one per run of whole CPU layers (one C call), one per other layer with a cold part or host
        # attention, one for the logits (or the head's input)
        from online.gpu.cpu_runs import CpuLayers
        c_layers = CpuLayers.build(engine.model, engine.executor)
        kinds = ["C" if c_layers is not None and c_layers.whole(i) else
                 ("x" if s.cpu is not None or not getattr(b.self_attn, "on_tier", False) else "g")
                 for i, (s, b) in enumerate(zip(engine.executor.splits, engine.model.layers))]
        runs = sum(1 for i, k in enumerate(kinds) if k == "C" and (i == 0 or kinds[i - 1] != "C"))
        names = [a.name for a in step.layers.runner_actions]
        assert sum(n.startswith("C layers") for n in names) == runs
        if head_on_host and c_layers is not None:  # the output layer in C: alone, or ending the last C run
            assert names[-1] == "C output layer" or names[-1].endswith("+ output layer"), names
        # at most: one per run of CPU layers, one per other layer using both devices, one for the logits; a
        # fetch is skipped where the host wrote the stream last (its embedding, a C run, host attention)
        assert 0 <= syncs_per_token <= runs + kinds.count("x") + 1, (fraction, syncs_per_token, kinds)
        assert runs + kinds.count("x") <= cold_layers + host_attention
        if cold_layers == 0 and host_attention == 0 and not head_on_host:
            assert step.graphs_per_token == 1
    assert seen_groups[1.0] == 1  # everything on the tier: one group (one CUDA graph) per token


def test_gpu_step_refuses_models_it_does_not_cover(tiny_model_dir, tmp_path_factory):
    folder, _ = tiny_model_dir("opt")
    plan_dir = tiny_plan(folder, tmp_path_factory.mktemp("gpu-step-opt"), "rtx4090", 1.0)
    engine = Engine.load(str(folder), plan=plan_dir, gpu_device="cpu", fused_decode=False)
    assert not engine.use_gpu_step(backend="torch")
    assert "layer norm" in engine.decode_path_reason
    with pytest.raises(GpuStepUnavailable):
        from online.gpu.graph_step import GpuDecodeStep
        GpuDecodeStep.build(engine.model, engine.executor, capture=False, backend="torch")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("attention,head,embeddings", [((True, False), False, True), ((False, True), True, False),
                                                        ((True, True), True, True)])
def test_gpu_program_with_hot_and_cold_rows_equals_dense(tiny_model_dir, kind, attention, head, embeddings):
    """40 hot neurons per layer on the tier, the rest cold on the CPU, all active: each decode token of the
    program equals the dense model's (transformers-checked) logits."""
    from online.gpu.graph_step import GpuDecodeStep
    from tandem.core.ffn import DenseExecutor
    from tandem.core.kv_cache import KVCache
    from tandem.core.loading.hf_loader import load_hf_folder
    from tandem.core.model.build import build_model
    folder, _ = tiny_model_dir(kind)
    model, ffn = build_model(load_hf_folder(folder))
    dense = DenseExecutor(model.cfg, ffn)
    cache = KVCache(model.cfg, 16)
    ref = [model(torch.tensor([t]), pos, cache, dense)[0] for pos, t in enumerate(PROMPT)]
    attention = tuple(attention[i % 2] for i in range(model.cfg.num_layers))  # the pattern over every layer
    model, executor, tier = tier_units_model(folder, attention, head, embeddings)
    step = GpuDecodeStep.build(model, executor, capture=False, backend="torch")
    cache = KVCache(model.cfg, 16)
    got = [step(t, pos, cache) for pos, t in enumerate(PROMPT)]
    torch.testing.assert_close(torch.stack(got), torch.stack(ref), rtol=1e-4, atol=1e-4)
    assert all(s.cpu is not None and s.gpu is not None for s in executor.splits)
    # one exchange per layer (its cold rows; host attention's fetch serves them) and one for the logits, less
    # the first layer's when its attention runs on the host right after the host's embedding
    before = tier.exchanges
    step(PROMPT[0], len(PROMPT), cache)
    embedded_on_tier = getattr(model.embed_tokens, "on_tier", False)  # tied: it follows the output layer
    assert tier.exchanges - before == model.cfg.num_layers + 1 - (0 if attention[0] or embedded_on_tier else 1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_layer_offload_tier_layers_as_one_program(tiny_model_dir, kind):
    """--layer-offload with its tier layer run as the GPU program (torch ops, eager) + the C range equals
    the same engine through the modules, with one exchange per token."""
    from online.execution.layer_offload import layer_tier_bytes
    folder, _ = tiny_model_dir(kind)
    probe = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=0, gpu_device="cpu")
    budget = layer_tier_bytes(probe.config, "q8", torch.float16, probe.max_context) + 100
    engine = Engine.load(folder, weight_format="int8", layer_offload=True, gpu_budget_bytes=budget, gpu_device="cpu")
    reference = engine.step_logits(PROMPT)
    step = engine.compiled_decode
    assert step.gpu_layers is None and step.use_gpu_program(capture=False, backend="torch") == ""
    tier = engine.executor.tier
    before = tier.exchanges
    got = engine.step_logits(PROMPT)
    assert (tier.exchanges - before) == len(PROMPT)
    # the tier layers agree to float noise (1e-6 relative); the C layers after them quantize activations to int8,
    # which Gemma 3's sandwich norms turn into up to 1e-2 of its softcapped logits
    tol = 2e-2 if kind == "gemma3" else 2e-3
    torch.testing.assert_close(got, reference, rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the captured graphs and Triton kernels")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_cuda_graph_step_equals_the_module_path(tiny_model_dir, tmp_path_factory, kind):
    folder, _ = tiny_model_dir(kind)
    out = tmp_path_factory.mktemp(f"cuda-step-{kind}")
    for fraction in (0.1, 0.5, 1.0):
        plan_dir = tiny_plan(folder, out, "rtx4090", fraction)
        modules = Engine.load(str(folder), plan=plan_dir, gpu_device="cuda", fused_decode=False)
        engine = Engine.load(str(folder), plan=plan_dir, gpu_device="cuda")
        if not engine.executor.tier.used_bytes:  # the plan put nothing on the GPU: the CPU's fused step
            assert engine.decode_path == "fused", engine.decode_path_reason
            continue
        assert engine.decode_path == "gpu-graph", engine.decode_path_reason
        # whole CPU layers run through the fused C step (int8 activations): as the CPU-tier test allows
        tol = 1e-1 if kind == "gemma3" else 2e-2
        torch.testing.assert_close(engine.step_logits(PROMPT), modules.step_logits(PROMPT), rtol=tol, atol=tol)
        a = engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
        if kind != "gemma3":  # (near-flat softcapped logits: see the CPU-tier test)
            assert a.token_ids == modules.generate(PROMPT, max_new_tokens=6, ignore_eos=True).token_ids
        assert a.stats["graph_replays_per_token"] > 0


def _int8_hybrid(folder, attention, seed=4, head=True):
    """A tiny model packed int8 with 40 hot neurons per layer on a CPU tier, attention where ``attention`` says,
    the output layer on the tier (``head``); and the module path's logits for PROMPT, token by token."""
    from online.execution.quantized_linear import quantize_attention
    from tandem.core.kv_cache import KVCache
    model, executor, _ = tier_units_model(folder, attention, head=head, embeddings=False, weight_format="int8",
                                          tier_format="q8", seed=seed)
    quantize_attention(model, "int8", 1, {})
    cache = KVCache(model.cfg, 16)
    with torch.inference_mode():
        ref = [model(torch.tensor([t]), pos, cache, executor)[0] for pos, t in enumerate(PROMPT)]
    return model, executor, torch.stack(ref)


def _step_logits(model, executor):
    from online.gpu.graph_step import GpuDecodeStep
    from tandem.core.kv_cache import KVCache
    step = GpuDecodeStep.build(model, executor, capture=False, backend="torch")
    cache = KVCache(model.cfg, 16)
    return step, torch.stack([step(t, pos, cache) for pos, t in enumerate(PROMPT)]), cache


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("attention", [(True, False), (False, True)])
def test_cold_rows_and_host_attention_in_c_equal_the_module_path(tiny_model_dir, kind, attention):
    """int8 weights, 40 hot neurons per layer on the tier: host attention and the cold rows run as C calls
    (tdm_decode_parts) beside the tier's launches; each token equals the same model's module path."""
    from online.gpu.cpu_runs import CpuLayers
    folder, hf = tiny_model_dir(kind)
    n = hf.config.num_hidden_layers
    attention = tuple(attention[i % 2] for i in range(n))  # the pattern over every layer (Gemma's tiny model: 3)
    model, executor, ref = _int8_hybrid(folder, attention)
    c_layers = CpuLayers.build(model, executor)
    # with sandwich norms (Gemma 3) the C call leaves the FFN output norm to the tier (hot + cold rows summed)
    assert c_layers is not None and all(c_layers.ffn(i) for i in range(n))
    assert not any(c_layers.step._layers[i].ffn_out_norm for i in range(n))  # every layer here has hot rows
    assert [c_layers.attention(i) for i in range(n)] == [not a for a in attention]
    step, got, cache = _step_logits(model, executor)
    names = [a.name for a in step.layers.runner_actions]
    assert any(a.startswith("C attention") for a in names) and sum(a.startswith("cold FFN") for a in names) == n
    tol = 5e-2 if model.cfg.sandwich_norms else 1e-2  # C: int8 activations (scaled up by Gemma's sandwich norms)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    with pytest.raises(TandemError, match="exceeds the 16-token KV cache"):  # the tier's cache, as the modules say
        step(PROMPT[0], 16, cache)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("all_attention_on_tier", [False, True])
def test_host_embedding_and_output_layer_in_c(tiny_model_dir, kind, all_attention_on_tier):
    """Embeddings and the output layer on the host: the embedding row and the logits come from C calls
    (tdm_embed, tdm_decode_range over no layers), not the modules, also where no layer has a part in C
    (Gemma 3 with every attention on the tier); each token equals the module path."""
    folder, hf = tiny_model_dir(kind)
    n = hf.config.num_hidden_layers
    pattern = tuple(all_attention_on_tier or i % 2 == 1 for i in range(n))
    model, executor, ref = _int8_hybrid(folder, pattern, head=False)
    assert executor.tier_head is None and executor.head is not None
    step, got, _ = _step_logits(model, executor)
    names = [a.name for a in step.layers.runner_actions]
    assert names[1] == "C embedding" and names[-1] == "C output layer", names
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)  # C: int8 activations


def test_gate_biases_keep_the_cold_rows_in_python(tmp_path):
    """decode.c reads no gate bias: such layers' cold rows stay on the Python CPU part (and still match)."""
    import transformers as tf
    from online.gpu.cpu_runs import CpuLayers
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, mlp_bias=True)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in hf.model.layers:  # transformers starts biases at zero: make the gate's matter
            layer.mlp.gate_proj.bias.normal_(0, 0.5)
            layer.mlp.up_proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    model, executor, ref = _int8_hybrid(tmp_path, (True, False))
    c_layers = CpuLayers.build(model, executor)
    assert c_layers is not None and not any(c_layers.ffn(i) for i in range(2)) and c_layers.attention(1)
    _, got, _ = _step_logits(model, executor)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("act,predictor_on_tier", [("relu", False), ("silu", False), ("relu", True)])
def test_predictor_gated_cold_rows_in_c_beside_hot_rows_on_the_tier(tiny_model_dir, act, predictor_on_tier):
    """PowerInfer's layer: 40 hot rows on the tier, the cold rows gated by the layer's predictor on the host.
    The C call scores only the cold rows (the predictor's output rows sliced to them) and reads only the
    predicted ones; each token equals the module path, which maps the whole layer's prediction to them.
    A predictor the plan put on the tier (the module path fetches its mask) gates them through its host copy."""
    import dataclasses
    from online.execution.gpu_tier import GpuTier
    from online.execution.hybrid import ExecutionSettings, HybridExecutor
    from online.execution.quantized_linear import quantize_attention
    from online.execution.tier_units import place_plan_units
    from online.gpu.cpu_runs import CpuLayers
    from predictors.model import LayerEntry, LayerPredictor, PredictorSet
    from predictors.runtime import LayerGate
    from tandem.core.kv_cache import KVCache
    from tandem.core.loading.hf_loader import load_hf_folder
    from tandem.core.model.build import build_model
    folder, _ = tiny_model_dir("llama")
    ckpt = load_hf_folder(folder)
    ckpt = dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, hidden_act=act))
    model, ffn = build_model(ckpt)
    cfg, n = model.cfg, model.cfg.num_layers
    torch.manual_seed(2)
    pset = PredictorSet([LayerEntry("predictor", LayerPredictor(cfg.hidden_size, 32, cfg.intermediate_size).eval()
                                    .requires_grad_(False), threshold=0.0) for _ in range(n)])  # ~half predicted
    gates = [LayerGate(pset, i) for i in range(n)]
    gen = torch.Generator().manual_seed(3)
    hot = [torch.randperm(cfg.intermediate_size, generator=gen)[:40] for _ in range(n)]
    tier = GpuTier.create(1 << 24, "cpu")
    settings = ExecutionSettings(weight_format="int8", down_format="fp32", sparse=True, threads=1)
    executor = HybridExecutor.build(cfg, ffn, tier, settings, gpu_neurons=hot, thresholds=[0.0 if act == "relu" else 0.01] * n,
                                    predictors=gates, head_weight=model.lm_head.weight)
    place_plan_units(model, executor, tier, attention_on_gpu=[True] * n, output_head_on_gpu=True, embeddings_on_gpu=False,
                     tier_format="q8", kv_dtype=torch.float32, kv_capacity_tokens=16)
    if predictor_on_tier:
        from online.execution.tier_units import place_predictors
        place_predictors(executor, tier, gates, [True] * n)
        assert all(getattr(s.predictor, "on_tier", False) for s in executor.splits)
    quantize_attention(model, "int8", 1, {})
    c_layers = CpuLayers.build(model, executor)
    assert c_layers is not None and all(c_layers.ffn(i) and not c_layers.whole(i) for i in range(n))
    cache = KVCache(cfg, 16)
    with torch.inference_mode():
        ref = torch.stack([model(torch.tensor([t]), pos, cache, executor)[0] for pos, t in enumerate(PROMPT)])
    active_module = executor.counters.ffn_neurons_active
    step, got, _ = _step_logits(model, executor)
    names = [a.name for a in step.layers.runner_actions]
    assert sum(a.startswith("cold FFN") for a in names) == n
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)  # C: int8 activations
    # the predictor gates the cold rows in C as in the modules: about as many neurons computed (a row at the
    # predictor's threshold may flip under int8 activations)
    active_step = executor.counters.ffn_neurons_active - active_module
    assert abs(active_step - active_module) <= 0.05 * active_module
    total = len(PROMPT) * n * cfg.intermediate_size
    assert active_module < 0.75 * total  # the predictor (and ReLU's zeros) did leave rows out
