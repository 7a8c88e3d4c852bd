"""The offline pipeline as functions: profile -> train predictors -> probe -> plan, typed results.

Each step writes its artifact (atomically, through the stage's own ``save_*``) and returns a frozen
result naming the folder, the loaded artifact and whether an existing valid one was reused. The
``tandem profile`` / ``train-predictors`` / ``plan`` / ``prepare`` commands are thin wrappers
around these functions: no argv round trips, nothing parsed back from printed lines. The plan steps
(``plan``, ``measure_quality``, ``ensure_quality``, ``warm_step_cache``) live in tandem/planning.py and are
re-exported here.

Example::

    from tandem import pipeline
    result = pipeline.prepare("smollm2", threads=2, gpu_budget="0")
    print(result.plan.path, result.plan.reused)          # profiles/<model-id>/plan-probed-0 False
    engine = Engine.load("smollm2", plan=result.plan.path)

Stage modules are imported inside the functions: importing this module costs nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tandem.core.artifacts import check_artifact_out, check_file_out
from offline.calibration import DEFAULT_MAX_QUALITY_LOSS, check_calibration_inputs
from tandem.core.errors import ArtifactError, TandemError
from tandem.planning import (PlanResult, check_quality_tokens, ensure_quality, measure_quality, plan,  # noqa: F401
                             plan_settings, warm_step_cache)

Log = Callable[[str], None]
MIN_TRAIN_TOKENS = 64  # calibration tokens predictors train on at least (train-predictors --tokens)


def _quiet(_: str) -> None:
    return None


@dataclass(frozen=True)
class ProfileResult:
    """A profile artifact on disk: ``profile`` is the loaded ``offline.profile_artifact.Profile``."""
    path: Path
    profile: Any
    reused: bool


@dataclass(frozen=True)
class PredictorsResult:
    """A predictor artifact on disk: ``predictors`` is the ``predictors.PredictorSet`` (None when reused)."""
    path: Path
    predictors: Any
    reused: bool


@dataclass(frozen=True)
class PrepareResult:
    """Everything ``prepare`` produced or reused; ``predictors`` is None for models that run exact."""
    profile: ProfileResult
    predictors: PredictorsResult | None
    hardware_path: Path
    plan: PlanResult


def profile(model: str | Path, *, out: str | Path | None = None, calib: Sequence[str] | None = None,
            tokens: int | None = None, self_generated_tokens: int = 0,
            max_quality_loss: float = DEFAULT_MAX_QUALITY_LOSS, window_tokens: int = 256, search_steps: int = 7,
            threads: int | None = None, progress: bool = True, plot: bool = False, engine: Any = None) -> ProfileResult:
    """Profile ``model`` on calibration text and save the artifact (default profiles/<model-id>/profile).

    ``engine``: an already loaded dense ``online.Engine`` of the same model (skips loading it again).
    """
    from offline.calibration import build_calibration_set
    from offline.plot import PLOT_FILE, render_profile_png
    from offline.profile_artifact import save_profile
    from offline.profiler import profile_model

    check_calibration_inputs(tokens, max_quality_loss, threads, calib)  # before the model loads
    if out:
        check_artifact_out(out, "profile")
    start = time.perf_counter()
    engine = engine if engine is not None else _load_engine(model, threads)
    calib_set = build_calibration_set(engine, files=calib, max_tokens=tokens,
                                      self_generated_tokens=self_generated_tokens)
    prof = profile_model(engine, calib_set, max_quality_loss=max_quality_loss, window_tokens=window_tokens,
                         search_steps=search_steps, progress=progress)
    prof.extra["wall_s"] = round(time.perf_counter() - start, 3)
    prof.extra["cpu_s"] = round(time.process_time(), 3)
    out_dir = Path(out) if out else Path("profiles") / engine.model_id / "profile"
    save_profile(prof, out_dir, {PLOT_FILE: render_profile_png(prof)} if plot else None)
    return ProfileResult(out_dir, prof, reused=False)


def train_predictors(model: str | Path, profile_dir: str | Path, *, out: str | Path | None = None,
                     calib: Sequence[str] | None = None, tokens: int | None = None, target_recall: float = 0.95,
                     max_rank: int = 512, max_quality_loss: float | None = None, extra_loss: float | None = None,
                     eval_tokens: int | None = None, threads: int | None = None, progress: bool = True,
                     engine: Any = None) -> PredictorsResult:
    """Train, size and check per-layer predictors from a saved profile; save them (default
    profiles/<model-id>/predictors)."""
    from offline.calibration import build_calibration_set, read_text_files
    from offline.profile_artifact import load_profile
    from predictors.artifact import save_predictors
    from predictors.pipeline import (DEFAULT_EVAL_TOKENS, DEFAULT_EXTRA_LOSS, PREDICTORS_SUBDIR, build_predictors,
                                     calibration_files)
    from predictors.train import RANK_LADDER, TrainSettings

    if not Path(profile_dir).is_dir():
        raise TandemError(f"profile directory not found: {profile_dir}")
    if calib:
        read_text_files(calib)
    if out:
        from predictors.artifact import ARTIFACT_NAME
        check_artifact_out(out, ARTIFACT_NAME)
    start = time.perf_counter()
    engine = engine if engine is not None else _load_engine(model, threads)
    prof = load_profile(profile_dir, expected_model_fingerprint=engine.model_fingerprint)
    calib_set = build_calibration_set(engine, files=calibration_files(prof, calib), max_tokens=tokens)
    settings = TrainSettings(target_recall=target_recall, ranks=tuple(r for r in RANK_LADDER if r <= max_rank))
    pset = build_predictors(engine, prof, calib_set, settings, max_quality_loss=max_quality_loss,
                            extra_loss=DEFAULT_EXTRA_LOSS if extra_loss is None else extra_loss,
                            eval_tokens=eval_tokens or DEFAULT_EVAL_TOKENS, progress=progress)
    pset.meta["wall_s"] = round(time.perf_counter() - start, 3)
    out_dir = Path(out) if out else Path("profiles") / engine.model_id / PREDICTORS_SUBDIR
    save_predictors(pset, out_dir)
    return PredictorsResult(out_dir, pset, reused=False)


def probe(out: str | Path | None = None, *, threads: int | None = None, name: str = "probed") -> Any:
    """Measure this machine (``placement.hardware.HardwareProfile``); saved to ``out`` when given."""
    from placement.hardware import save_hardware
    from placement.probe import probe_machine
    if out is not None:
        check_file_out(out)
    hardware = probe_machine(threads=threads, name=name)
    if hardware.has_gpu:  # the GPU step's kernel latency (online/gpu), which the cost model charges per kernel
        import dataclasses
        from online.gpu.probe_launch import measure_launch_seconds
        hardware = dataclasses.replace(hardware, gpu_launch_s=measure_launch_seconds())
    if out is not None:
        try:
            save_hardware(hardware, out)
        except OSError as e:
            raise TandemError(f"cannot write {out}: {e.strerror or e}") from None
    return hardware


def prepare(model: str | Path, *, out: str | Path | None = None, hardware: str | Path | None = None,
            gpu_budget: str | int | None = None, predictors: str = "auto", tokens: int | None = None,
            max_quality_loss: float = DEFAULT_MAX_QUALITY_LOSS, calib: Sequence[str] | None = None,
            threads: int | None = None, progress: bool = True, quality: bool = True, replan: bool = False,
            log: Log = _quiet) -> PrepareResult:
    """probe -> profile -> (predictors) -> plan under ``out`` (default profiles/<model-id>), reusing each
    artifact that is still valid for the same model and inputs; ``log`` gets one line per step.

    ``predictors``: "auto" trains them for ReLU-family models only (on SwiGLU models they were
    measured not to pay), "on" / "off" force it. ``hardware``: preset or JSON file (default: probe
    this machine once, kept as ``<out>/hardware-probed.json``). ``gpu_budget``: default the GPU's
    free memory (90%), 0 without a GPU; hardware and budget are checked before the profile.
    ``tokens``: calibration tokens for a new profile and new predictors. ``quality``: measure the plan's
    quality unless it records one (``ensure_quality``). ``replan``: plan again even if a plan made from
    other inputs (hardware, predictors, budget) is in the way.
    """
    from placement.budget import format_bytes, parse_bytes
    from placement.hardware import load_hardware
    if predictors not in ("auto", "on", "off"):
        raise TandemError(f"predictors must be auto, on or off, got {predictors!r}")
    check_calibration_inputs(tokens, max_quality_loss, threads, calib)  # whether or not a profile is made
    hw = load_hardware(hardware) if hardware is not None else None  # an unknown preset or bad file fails now
    if gpu_budget is not None:
        parse_bytes(str(gpu_budget))  # a bad budget fails now, not after the profile
    if out:
        check_file_out(Path(out) / "hardware-probed.json")  # the folder can be made and written
    from tandem.core.loading import load_checkpoint
    checkpoint = load_checkpoint(model, deferred=True)  # its config, fingerprint and block kinds
    cfg, fingerprint = checkpoint.config, checkpoint.fingerprint
    train = predictors == "on" or (predictors == "auto" and cfg.ffn_is_relu_sparse)
    if train and tokens is not None and tokens < MIN_TRAIN_TOKENS:
        raise TandemError(f"tokens (--tokens) must be at least {MIN_TRAIN_TOKENS} to train predictors, got {tokens}")
    settings = plan_settings(checkpoint)  # what `plan` sets (weight format auto)
    base = Path(out) if out else Path("profiles") / checkpoint.model_id
    hardware_path = Path(hardware) if hardware is not None else base / "hardware-probed.json"
    if hw is None and not hardware_path.is_file():
        log(f"[prepare] measuring this machine into {hardware_path}")
        probe(hardware_path, threads=threads)
    elif hw is None:
        log(f"[prepare] reusing hardware profile {hardware_path}")
    hw = hw if hw is not None else load_hardware(hardware_path)
    budget = gpu_budget if gpu_budget is not None else _default_budget(hw)
    budget_bytes = parse_bytes(str(budget)) if budget is not None else None
    from placement.planner import check_budget, default_gpu_budget
    check_budget(cfg, hw, default_gpu_budget(hw) if budget_bytes is None else budget_bytes, settings)  # before work
    profile_dir, engine = base / "profile", None
    existing = _valid_profile(profile_dir, fingerprint)
    if existing is not None:
        note = (": calibration settings apply to a new profile only (remove it to profile again)"
                if calib or tokens is not None or max_quality_loss != DEFAULT_MAX_QUALITY_LOSS else "")
        log(f"[prepare] reusing profile {profile_dir}{note}")
        prof = ProfileResult(profile_dir, existing, reused=True)
    else:
        log(f"[prepare] profiling into {profile_dir}")
        checkpoint = None  # not held while the engine profiles; the plan step loads it again
        engine = _load_engine(model, threads)
        prof = profile(model, out=profile_dir, calib=calib, tokens=tokens, max_quality_loss=max_quality_loss,
                       threads=threads, progress=progress, engine=engine)
    preds = None
    if train:
        predictors_dir = base / "predictors"
        if _predictors_valid(predictors_dir, fingerprint, prof.profile.fingerprint):
            log(f"[prepare] reusing predictors {predictors_dir}")
            preds = PredictorsResult(predictors_dir, None, reused=True)
        else:
            log(f"[prepare] training predictors into {predictors_dir}")
            checkpoint = None
            engine = engine if engine is not None else _load_engine(model, threads)
            preds = train_predictors(model, profile_dir, out=predictors_dir, tokens=tokens, threads=threads,
                                     progress=progress, engine=engine)
    del engine
    plan_dir = base / f"plan-{hw.name}-{format_bytes(budget_bytes) if budget_bytes is not None else 'default'}"
    stale = (plan_dir / "plan.json").is_file() and not _plan_matches(plan_dir, fingerprint, prof.profile.fingerprint,
                                                                     dict(settings.tensor_formats))
    if stale:
        log(f"[prepare] the plan in {plan_dir} is stale (its profile, model or tier formats changed): planning again")
    predictors_dir = preds.path if preds is not None else None
    result = plan(model, profile_dir, hardware_path, gpu_budget=budget, predictors_dir=predictors_dir, out=plan_dir,
                  replan=stale or replan, checkpoint=checkpoint, quality=quality, command="prepare")
    del checkpoint  # not held while the quality measurement loads its engines
    if quality:
        ensure_quality(result, model, profile_dir, predictors_dir, log=lambda line: log(f"[prepare] {line}"))
    log(f"[prepare] {'reusing' if result.reused else 'wrote'} plan {plan_dir}")
    cached = warm_step_cache(model, plan_dir, profile_dir, predictors_dir)
    if cached is not None:
        log(f"[prepare] prepared-step cache {cached}")
    return PrepareResult(prof, preds, hardware_path, result)


def _default_budget(hardware: Any) -> str | None:
    """The GPU's free memory (90%) when torch sees one; 0 for GPU-less hardware; else the planner's default."""
    import torch
    if torch.cuda.is_available():
        free_bytes, _ = torch.cuda.mem_get_info()
        return str(int(free_bytes * 0.9))
    return "0" if not hardware.has_gpu else None


def _valid_profile(path: Path, fingerprint: str) -> Any:
    from offline.profile_artifact import load_profile
    try:
        return load_profile(path, expected_model_fingerprint=fingerprint)
    except ArtifactError:
        return None


def _predictors_valid(path: Path, fingerprint: str, profile_fingerprint: str) -> bool:
    if not (path / "predictors.json").is_file():
        return False
    from predictors.artifact import load_predictors
    try:
        load_predictors(path, expected_model_fingerprint=fingerprint, expected_profile_fingerprint=profile_fingerprint)
        return True
    except TandemError:
        return False


def _plan_matches(plan_dir: Path, fingerprint: str, profile_fingerprint: str,
                  tensor_formats: dict[str, str] | None = None) -> bool:
    """The plan was made for this model and profile (and, when given, these per-tensor tier formats)."""
    from placement.plan import load_plan
    try:
        found = load_plan(plan_dir, model_fingerprint=fingerprint, profile_fingerprint=profile_fingerprint)
    except TandemError:
        return False
    return tensor_formats is None or dict(found.settings.tensor_formats) == tensor_formats


def _load_engine(model: str | Path, threads: int | None) -> Any:
    from online import Engine
    return Engine.load(model, threads=threads)
