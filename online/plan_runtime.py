"""Turn a plan directory (plus its profile and predictors) into a HybridExecutor.

Layout written by ``tandem prepare``: ``profiles/<model-id>/{profile, predictors, plan-<hw>-<budget>}``;
a plan finds its profile and predictors beside it unless they are given explicitly. Every artifact's
fingerprint is checked against the model and against what the plan was made from.

Example::

    executor, info = build_plan_executor(plan_dir, cfg, ffn_layers, ckpt_fingerprint, settings,
                                         head_weight=model.lm_head.weight, raw=ckpt.raw)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tandem.core.errors import TandemError
from .execution.gpu_tier import GpuTier
from .execution.hybrid import ExecutionSettings, HybridExecutor
from tandem.core.tier_format import expert_format_for, tier_format_for


@dataclass(frozen=True)
class PlanInfo:
    plan_dir: Path
    profile_dir: Path | None
    predictors_dir: Path | None
    hardware: str
    gpu_budget_bytes: int
    gpu_bytes_planned: int
    modeled_tokens_per_s: float | None
    attention_on_gpu: tuple[bool, ...] = ()
    output_head_on_gpu: bool = False
    embeddings_on_gpu: bool = False
    tier_format: str = "fp32"
    kv_bytes_per_element: float = 4.0
    context_tokens: int = 0


def _sibling(plan_dir: Path, explicit: str | Path | None, name: str) -> Path | None:
    if explicit is not None:
        return Path(explicit)
    candidate = plan_dir.resolve().parent / name
    return candidate if candidate.is_dir() else None


def _names_experts(formats: dict[str, str]) -> bool:
    """Whether a plan's tensor formats keep its experts in the file's blocks (placement.settings' ``experts``)."""
    return any(key.endswith("experts") for key in formats)


def _check_tensor_formats(plan, plan_dir: Path, tensor_formats: dict[str, str] | None) -> None:
    """A plan that keeps GGUF blocks as they are runs only on the file whose formats it recorded."""
    planned = dict(plan.settings.tensor_formats)
    if tensor_formats is not None and not _names_experts(planned):  # made before the role: experts re-quantized
        tensor_formats = {k: v for k, v in tensor_formats.items() if not k.endswith("experts")}
    if planned and tensor_formats is not None and planned != tensor_formats:
        role = next(r for r in sorted(set(planned) | set(tensor_formats)) if planned.get(r) != tensor_formats.get(r))
        raise TandemError(f"the plan in {plan_dir} was made for a file that stores {role} as "
                          f"{planned.get(role, 'nothing')}; this one stores {tensor_formats.get(role, 'nothing')} "
                          "(another quantization of the model?): plan again for this file")


def build_plan_executor(plan_dir: str | Path, cfg, ffn_layers: list, model_fingerprint: str,
                        settings: ExecutionSettings, head_weight=None, raw: dict | None = None,
                        gpu_budget_bytes: int | None = None, profile_dir: str | Path | None = None,
                        predictors_dir: str | Path | None = None, expert_slots: int | None = None,
                        prefetch: bool = True, model=None,
                        tensor_formats: dict[str, str] | None = None) -> tuple[HybridExecutor, PlanInfo]:
    """MoE layers get the plan's expert cache (slots, pinned experts); ``expert_slots`` overrides the slots.
    With ``model`` the plan's attention/KV, output layer and embeddings go on the tier first (experts get the rest).
    ``tensor_formats``: the checkpoint's own (``checkpoint_tensor_formats``), which a plan that keeps GGUF blocks
    as they are must have been made for."""
    from offline.profile_artifact import load_profile
    from placement.plan import load_plan, read_plan
    plan_dir = Path(plan_dir)
    plan = read_plan(plan_dir)
    if gpu_budget_bytes is not None and gpu_budget_bytes < plan.gpu_bytes:
        raise TandemError(f"--gpu-budget {gpu_budget_bytes} bytes is smaller than the plan in {plan_dir} needs "
                          f"({plan.gpu_bytes} bytes on the GPU tier); plan again with this budget")
    profile_path = _sibling(plan_dir, profile_dir, "profile")
    if profile_path is None:
        raise TandemError(f"no profile found for the plan in {plan_dir} (expected {plan_dir.resolve().parent / 'profile'}); "
                          "pass the profile directory explicitly")
    profile = load_profile(profile_path, expected_model_fingerprint=model_fingerprint)
    predictors = None
    predictors_path = _sibling(plan_dir, predictors_dir, "predictors")
    predictors_fingerprint = "none"
    if predictors_dir is not None and plan.predictors_fingerprint == "none":
        raise TandemError(f"the plan in {plan_dir} runs without predictors: leave --predictors out")
    if plan.predictors_fingerprint != "none":
        if predictors_path is None:
            raise TandemError(f"the plan in {plan_dir} was made with predictors, but none were found beside it")
        from predictors.runtime import load_runtime_predictors
        predictors, predictors_fingerprint = load_runtime_predictors(predictors_path, model_fingerprint,
                                                                     profile.fingerprint)
    plan = load_plan(plan_dir, model_fingerprint=model_fingerprint, profile_fingerprint=profile.fingerprint,
                     predictors_fingerprint=predictors_fingerprint,
                     gpu_budget_bytes=gpu_budget_bytes if gpu_budget_bytes is not None else plan.gpu_budget_bytes)
    _check_tensor_formats(plan, plan_dir, tensor_formats)  # after load_plan: another model's plan says so first
    from placement.quality import quality_warning
    warning = quality_warning(plan.quality)
    if warning is not None:  # one line on stderr, as the CLI's errors
        import sys
        print(f"warning: {plan_dir}: {warning}", file=sys.stderr)
    tier = GpuTier.create(plan.gpu_budget_bytes, settings.gpu_device, threads=settings.threads)
    settings = replace(settings, tier_format=tier_format_for(plan.settings.bytes_per_weight),  # the plan's bytes,
                       tier_formats=plan.settings.tensor_formats)  # and its format per tensor role
    thresholds = [float(t) for t in profile.thresholds.tolist()]
    gpu_neurons = [plan.gpu_neurons(i) if not cfg.is_moe_layer(i) else None for i in range(cfg.num_layers)]
    executor = HybridExecutor.build(cfg, ffn_layers, tier, settings, gpu_neurons=gpu_neurons, thresholds=thresholds,
                                    predictors=predictors, head_weight=head_weight, raw=raw,
                                    pack_experts=not cfg.is_moe)  # MoE: the expert runtime below packs them
    if predictors is not None:  # before the plan units: a tier attention fetches its layer's predictor mask
        from .execution.tier_units import place_predictors
        place_predictors(executor, tier, predictors, [bool(layer.get("predictor_on_gpu")) for layer in plan.layers])
    if model is not None:
        from .execution.tier_units import kv_dtype_for, place_plan_units
        place_plan_units(model, executor, tier, attention_on_gpu=plan.attention_on_gpu,
                         output_head_on_gpu=plan.output_head_on_gpu, embeddings_on_gpu=plan.embeddings_on_gpu,
                         tier_format=settings.tier_format_of, kv_dtype=kv_dtype_for(plan.settings.kv_bytes_per_element),
                         kv_capacity_tokens=plan.settings.context_tokens, raw=raw)
    if cfg.is_moe:
        from .experts.runtime import ExpertRuntime, default_cost_model
        from .execution.tier_units import place_shared_experts
        shared = place_shared_experts(cfg, ffn_layers, tier, [bool(layer.get("shared_expert_on_gpu"))
                                                                   for layer in plan.layers], settings.tier_format_of, raw)
        slots = plan.expert_cache_slots if expert_slots is None else expert_slots
        executor.attach_experts(ExpertRuntime(cfg, ffn_layers, tier,
                                              weight_format=expert_format_for(plan.settings.bytes_per_weight),
                                              slots=slots, pinned=plan.expert_pinned, prefetch=prefetch,
                                              cost_model=default_cost_model(tier, plan.hardware),
                                              threads=settings.threads, fit_to_budget=expert_slots is None,
                                              raw=raw if _names_experts(dict(plan.settings.tensor_formats))
                                              else None))  # the file's blocks where the plan counted them
        executor.experts.tier_shared = shared
    info = PlanInfo(plan_dir=plan_dir, profile_dir=profile_path, predictors_dir=predictors_path if predictors else None,
                    hardware=plan.hardware.name, gpu_budget_bytes=plan.gpu_budget_bytes, gpu_bytes_planned=plan.gpu_bytes,
                    modeled_tokens_per_s=plan.modeled.get("tokens_per_s"),
                    attention_on_gpu=tuple(plan.attention_on_gpu), output_head_on_gpu=plan.output_head_on_gpu,
                    embeddings_on_gpu=plan.embeddings_on_gpu, tier_format=settings.tier_format,
                    kv_bytes_per_element=plan.settings.kv_bytes_per_element, context_tokens=plan.settings.context_tokens)
    return executor, info

