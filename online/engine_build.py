"""The executor an EngineArgs asks for, built in one place: dense float32, hybrid from a plan, a MoE expert
cache without a plan, packed CPU-only weights, or llama.cpp-style layer offload.

Example::

    args = EngineArgs(model="smollm2", weight_format="int4")
    ckpt = load_checkpoint(args.model)
    net, ffn_layers = build_model(ckpt)
    built = build_executor(args, ckpt, net, ffn_layers)   # BuiltExecutor(executor, plan_info, gpu_layers)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.core.ffn import DenseExecutor
from tandem.core.ffn.contract import Executor

from .engine_args import EngineArgs


@dataclass(frozen=True)
class BuiltExecutor:
    executor: Executor
    plan_info: Any = None  # online.plan_runtime's PlanInfo when a plan was loaded
    gpu_layers: int | None = None  # layer offload: how many whole layers run on the GPU tier


def default_weight_format(raw: dict) -> str:
    """int4 when the checkpoint's FFN weights (a MoE model's: its first expert's) are GGUF Q4 blocks (read
    exactly, no re-quantization), else int8."""
    names = ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight")
    up = next((raw[n] for n in names if raw.get(n) is not None), None)
    return "int4" if getattr(up, "qtype", None) in ("Q4_0", "Q4_1") else "int8"


def build_executor(args: EngineArgs, ckpt, net, ffn_layers: list) -> BuiltExecutor:
    """The executor for ``args`` over the built model ``net`` (attention is packed in place when the FFN is)."""
    if args.layer_offload:
        return _layer_offload(args, ckpt, net, ffn_layers)
    if not args.packed:
        return BuiltExecutor(DenseExecutor(ckpt.config, ffn_layers))
    # the packed runtime's modules load the kernels: imported here, so a dense engine never pays
    from .execution.hybrid import ExecutionSettings
    from .execution.quantized_linear import quantize_attention
    raw = ckpt.raw
    default_format = "fp32" if args.plan is None and args.expert_slots is not None else default_weight_format(raw)
    settings = ExecutionSettings(weight_format=args.weight_format or default_format, sparse=args.sparse,
                                 **({"down_format": args.down_format} if args.down_format is not None else {}),
                                 threads=args.threads or torch.get_num_threads(), gpu_device=args.gpu_device)
    head = net.lm_head.weight if args.weight_format is not None or args.plan is not None else None
    if args.plan is not None:
        built = _from_plan(args, ckpt, net, ffn_layers, settings, head)
    elif args.expert_slots is not None:
        built = BuiltExecutor(_expert_cache(args, ckpt, ffn_layers, settings, head))
    else:
        from .execution.gpu_tier import GpuTier
        from .execution.hybrid import HybridExecutor
        built = BuiltExecutor(HybridExecutor.build(ckpt.config, ffn_layers, GpuTier.create(0, "cpu"), settings,
                                                   head_weight=head, raw=raw))
    if settings.weight_format != "fp32":
        quantize_attention(net, settings.weight_format, settings.threads, raw)
    pin_float_leftovers(net, built.executor, ffn_layers)
    return built


def pin_float_leftovers(net, executor, ffn_layers: list) -> int:
    """Decode once, and keep, the deferred weights a packed engine still computes with in float32 on every token
    (loading/deferred.py): attention left as float modules (fp32), the float output layer when nothing packed
    it, MoE routers and shared experts, and float MoE layers without an expert runtime. Returns how many."""
    from torch import nn
    from tandem.core.ffn.weights import FFNWeights, MoELayerWeights
    from tandem.core.loading.deferred import pin_deferred
    packed_head = getattr(executor, "head", None) is not None or getattr(executor, "tier_head", None) is not None
    weights = [m.weight for name, m in net.named_modules()
               if isinstance(m, nn.Linear) and not (name == "lm_head" and packed_head)]
    float_moe, block_moe = getattr(executor, "float_moe", {}), getattr(executor, "block_moe", {})
    runtime_shared = getattr(getattr(executor, "experts", None), "cpu_shared", {})
    for i, w in enumerate(ffn_layers):
        if not isinstance(w, MoELayerWeights):
            continue
        packed_shared = i in block_moe or i in runtime_shared  # (packed experts: only the router, gate vector)
        ffns = (([] if packed_shared else [w.shared_expert])
                + (list(w.experts) if i in float_moe and i not in block_moe else []))
        weights += [w.router, w.shared_expert_gate] + [t for f in ffns if isinstance(f, FFNWeights)
                                                       for t in vars(f).values()]
    return pin_deferred(weights)


def _layer_offload(args: EngineArgs, ckpt, net, ffn_layers: list) -> BuiltExecutor:
    """llama.cpp -ngl on our kernels (online/execution/layer_offload.py)."""
    from .execution.hybrid import ExecutionSettings
    from .execution.layer_offload import build_layer_offload
    from .execution.quantized_linear import quantize_attention
    cfg, raw = ckpt.config, ckpt.raw
    settings = ExecutionSettings(weight_format=args.weight_format or default_weight_format(raw), sparse=False,
                                 threads=args.threads or torch.get_num_threads(), gpu_device=args.gpu_device)
    capacity = min(args.context_length or cfg.max_context, cfg.max_context)
    executor, gpu_layers = build_layer_offload(net, ffn_layers, settings, args.gpu_budget_bytes, capacity, raw)
    if settings.weight_format != "fp32":
        quantize_attention(net, settings.weight_format, settings.threads, raw)
    pin_float_leftovers(net, executor, ffn_layers)
    return BuiltExecutor(executor, gpu_layers=gpu_layers)


def _from_plan(args: EngineArgs, ckpt, net, ffn_layers: list, settings, head) -> BuiltExecutor:
    from placement.settings import checkpoint_tensor_formats
    from .plan_runtime import build_plan_executor
    executor, plan_info = build_plan_executor(args.plan, ckpt.config, ffn_layers, ckpt.fingerprint, settings,
                                              head_weight=head, raw=ckpt.raw, gpu_budget_bytes=args.gpu_budget_bytes,
                                              expert_slots=args.expert_slots, prefetch=args.prefetch,
                                              profile_dir=args.profile, predictors_dir=args.predictors, model=net,
                                              tensor_formats=checkpoint_tensor_formats(ckpt))
    return BuiltExecutor(executor, plan_info=plan_info)


def _expert_cache(args: EngineArgs, ckpt, ffn_layers: list, settings, head):
    """A MoE expert cache on the GPU tier without a plan: ``expert_slots`` per layer."""
    from .execution.gpu_tier import GpuTier
    from .execution.hybrid import HybridExecutor
    from .experts.runtime import ExpertRuntime, tier_bytes_needed
    cfg = ckpt.config
    budget = args.gpu_budget_bytes if args.gpu_budget_bytes is not None else tier_bytes_needed(
        cfg, ffn_layers, settings.weight_format, args.expert_slots, raw=ckpt.raw)
    tier = GpuTier.create(budget, args.gpu_device)
    executor = HybridExecutor.build(cfg, ffn_layers, tier, settings, head_weight=head, raw=ckpt.raw,
                                    pack_experts=False)  # the runtime below packs them
    executor.attach_experts(ExpertRuntime(cfg, ffn_layers, tier, weight_format=settings.weight_format,
                                          slots=args.expert_slots, prefetch=args.prefetch, threads=settings.threads,
                                          raw=ckpt.raw))  # Q4_0 / Q4_1 (int4) or Q8_0 (int8) experts kept
    return executor
