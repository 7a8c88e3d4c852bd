"""The plan steps of ``tandem.pipeline`` (which re-exports them): plan, measure its quality, warm its step cache.

A new plan is written once with its quality recorded as pending (or as skipped, for ``--no-quality``),
then again, atomically, with the measurement. A run that wants quality measures a reused plan that
lacks it (``ensure_quality``): an interrupted measurement is finished by the next run, never taken
for a ``--no-quality`` plan.

Example::

    from tandem import pipeline
    result = pipeline.plan("smollm2", "profiles/M/profile", "rtx4090", gpu_budget="2GiB")
    pipeline.ensure_quality(result, "smollm2", "profiles/M/profile")   # measures it unless already measured

Stage modules are imported inside the functions: importing this module costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tandem.core.artifacts import check_artifact_out
from tandem.core.errors import ArtifactError, TandemError


@dataclass(frozen=True)
class PlanResult:
    """A plan on disk: ``plan`` is the loaded ``placement.plan.Plan``; ``Engine.load(model, plan=path)`` runs it."""
    path: Path
    plan: Any
    reused: bool
    profile: Any = None  # the offline.profile_artifact.Profile it was planned from


def plan_settings(checkpoint: Any, weight_format: str | float = "auto", context_tokens: int | None = None,
                  neurons_per_chunk: int = 64, min_gpu_neurons: int = 128) -> Any:
    """The ``placement.settings.PlanSettings`` that ``plan`` uses for ``checkpoint`` (``prepare`` checks its
    budget against them before any work)."""
    from placement.settings import PlanSettings, checkpoint_bytes_per_weight, checkpoint_tensor_formats
    from placement.settings import resolve_bytes_per_weight
    config = checkpoint.config
    if context_tokens is not None and not 1 <= context_tokens <= config.max_context:
        raise TandemError(f"the context to plan for must be 1..{config.max_context} tokens (the model's), "
                          f"got {context_tokens}")
    bytes_per_weight = (checkpoint_bytes_per_weight(checkpoint) if weight_format == "auto"
                        else resolve_bytes_per_weight(_number_or_name(weight_format)))
    tensor_formats = checkpoint_tensor_formats(checkpoint) if weight_format == "auto" else {}  # GGUF blocks as they are
    return PlanSettings(bytes_per_weight=bytes_per_weight, tensor_formats=tensor_formats,
                        context_tokens=context_tokens or min(config.max_context, 2048),
                        neurons_per_chunk=neurons_per_chunk, min_gpu_neurons_per_layer=min_gpu_neurons)


def plan(model: str | Path, profile_dir: str | Path, hardware: str | Path, *, gpu_budget: str | int | None = None,
         predictors_dir: str | Path | None = None, out: str | Path | None = None, replan: bool = False,
         time_limit_s: float = 30.0, weight_format: str | float = "auto", context_tokens: int | None = None,
         neurons_per_chunk: int = 64, min_gpu_neurons: int = 128, checkpoint: Any = None, quality: bool = True,
         command: str = "plan") -> PlanResult:
    """Plan what lives on the GPU for ``hardware`` (preset or JSON file) within ``gpu_budget`` (bytes or
    "2GiB"; default 90% of the GPU). An existing plan at ``out`` made from the same inputs is reused;
    one made from other inputs is refused unless ``replan`` (the message names ``tandem <command> --replan``).
    A new plan records its quality as pending when ``quality`` (``ensure_quality`` measures it next),
    as skipped (``--no-quality``) otherwise."""
    from offline.profile_artifact import load_profile
    from tandem.core.loading import load_checkpoint
    from placement.budget import format_bytes, parse_bytes
    from placement.hardware import load_hardware
    from placement.ilp import SolverSettings
    from placement.plan import load_plan, save_plan
    from placement.planner import check_budget, default_gpu_budget, make_plan
    from placement.predictor_info import load_predictor_info, no_predictors
    from placement.quality import QUALITY_PENDING, QUALITY_SKIPPED

    hw = load_hardware(hardware)
    budget = default_gpu_budget(hw) if gpu_budget is None else parse_bytes(str(gpu_budget))
    checkpoint = checkpoint if checkpoint is not None else load_checkpoint(model, deferred=True)  # config, sizes, kinds
    config = checkpoint.config
    settings = plan_settings(checkpoint, weight_format, context_tokens, neurons_per_chunk, min_gpu_neurons)
    prof = load_profile(profile_dir, expected_model_fingerprint=checkpoint.fingerprint)
    preds = (load_predictor_info(predictors_dir, config.num_layers, checkpoint.fingerprint, prof.fingerprint)
             if predictors_dir else no_predictors(config.num_layers))
    check_budget(config, hw, budget, settings)
    out_dir = Path(out) if out else Path("profiles") / checkpoint.model_id / f"plan-{hw.name}-{format_bytes(budget)}"
    if (out_dir / "plan.json").exists() and not replan:
        try:
            existing = load_plan(out_dir, model_fingerprint=checkpoint.fingerprint,
                                 profile_fingerprint=prof.fingerprint, predictors_fingerprint=preds.fingerprint,
                                 hardware=hw, gpu_budget_bytes=budget, settings=settings, command=command)
        except ArtifactError as e:
            raise TandemError(f"refusing to overwrite: {e}") from None
        return PlanResult(out_dir, existing, reused=True, profile=prof)
    check_artifact_out(out_dir, "plan")
    new_plan = make_plan(config, model_fingerprint=checkpoint.fingerprint, model_id=checkpoint.model_id, profile=prof,
                         hardware=hw, gpu_budget_bytes=budget, predictors=preds, settings=settings,
                         solver=SolverSettings(time_limit_s=time_limit_s))
    new_plan.quality_status = QUALITY_PENDING if quality else QUALITY_SKIPPED  # the truth if the run stops here
    try:
        save_plan(new_plan, out_dir)
    except OSError as e:
        raise TandemError(f"cannot write the plan to {out_dir}: {e.strerror or e}") from None
    return PlanResult(out_dir, new_plan, reused=False, profile=prof)


def check_quality_tokens(tokens: int) -> None:
    if tokens < 16:
        raise TandemError(f"quality_tokens must be at least 16, got {tokens}")


def measure_quality(result: PlanResult, model: str | Path, profile_dir: str | Path,
                    predictors_dir: str | Path | None = None, *, tokens: int | None = None,
                    gpu_device: str | None = None) -> PlanResult:
    """Measure a plan's held-out perplexity and greedy agreement with dense through the runtime it
    describes (``tokens`` held-out tokens, default 256) and record them in the plan on disk (one atomic
    write). It loads two engines: call it after letting go of the checkpoint given to ``plan``."""
    from placement.plan import save_plan
    from placement.quality import DEFAULT_QUALITY_TOKENS
    from online.plan_measure import measure_plan_quality
    tokens = DEFAULT_QUALITY_TOKENS if tokens is None else tokens
    check_quality_tokens(tokens)
    check_artifact_out(result.path, "plan")  # the plan can be written again: checked before the measurement
    quality = measure_plan_quality(model, result.path, max_tokens=tokens, gpu_device=gpu_device,
                                   max_quality_loss=result.profile.quality.get("max_quality_loss"),
                                   profile_dir=profile_dir, predictors_dir=predictors_dir)
    result.plan.quality, result.plan.quality_status = quality, ""
    try:
        save_plan(result.plan, result.path)
    except OSError as e:
        raise TandemError(f"cannot write the plan to {result.path}: {e.strerror or e}") from None
    return result


def ensure_quality(result: PlanResult, model: str | Path, profile_dir: str | Path,
                   predictors_dir: str | Path | None = None, *, tokens: int | None = None,
                   gpu_device: str | None = None, log: Callable[[str], None] | None = None) -> bool:
    """Measure the plan's quality (``measure_quality``) unless it already records one that answers this
    run: measured on ``tokens`` held-out tokens with the GPU tier on ``gpu_device`` (None: any). A new
    plan (quality pending), a ``--no-quality`` plan and one whose measurement was interrupted are
    measured. ``log`` gets one line when a reused plan is measured. Returns whether it measured."""
    from placement.quality import quality_shortfall
    why = quality_shortfall(result.plan, tokens, gpu_device)
    if why is None:
        return False
    if result.reused and log is not None:
        log(f"measuring the quality of the plan in {result.path}: {why}")
    measure_quality(result, model, profile_dir, predictors_dir, tokens=tokens, gpu_device=gpu_device)
    return True


def warm_step_cache(model: str | Path, plan_dir: str | Path, profile: str | Path | None = None,
                    predictors: str | Path | None = None) -> Path | None:
    """Write the plan's prepared-step cache (online/engine_cache.py) now, keyed as ``generate --plan``
    will look it up, so the first generation after ``plan``/``prepare`` starts from the cache. Its
    key covers plan.json, so this runs after the last write of the plan (its quality). Returns the
    cache file, or None where the plan does not run on the cached CPU step (a GPU tier, no C library).
    ``profile``/``predictors``: where the plan's are when they are not beside it (``plan --profile``).

    Example::

        warm_step_cache("smollm2", "profiles/SmolLM2/plan-cpu-only-0")   # .../step-cache/step-....safetensors
    """
    from online import Engine
    from online.engine_args import EngineArgs
    from online.engine_cache import cache_applies, cache_path, load_cached
    from tandem.core.loading.resolve import resolve_model_path
    from placement.plan import read_plan
    args = EngineArgs.create(str(model), plan=str(plan_dir), profile=None if profile is None else str(profile),
                             predictors=None if predictors is None else str(predictors))
    if not cache_applies(args) or sum(read_plan(Path(plan_dir)).gpu_bytes_by_kind.values()) > 0:
        return None  # the GPU tier holds part of it: no cached CPU step to write
    if load_cached(args) is None:
        Engine.from_args(args)  # builds the modules and writes the cache (engine_lazy.load_fast)
    return cache_path(args, resolve_model_path(args.model)) if load_cached(args) is not None else None


def _number_or_name(text: str | float) -> str | float:
    try:
        return float(text)
    except ValueError:
        return text
