"""The offline pipeline as functions: profile -> train predictors -> probe -> plan, typed results.

Each step is the same code as its command (``tandem profile``, ``train-predictors``, ``probe``,
``plan``): the step function fills that command's options (its parser's defaults, then the values
given) and calls its handler directly: no argv, no parsing of printed lines. Artifacts land where
the step is told (``out``), so the result names them without reading any output. ``prepare`` reuses
every artifact that is still valid for the model and its inputs.

Example::

    from tandem.pipeline import PrepareSettings, prepare
    result = prepare(PrepareSettings(model="smollm2", threads=2))
    result.plan_dir            # Path("profiles/SmolLM2-135M-Instruct.Q4_1/plan-probed-0")
    [s.name for s in result.steps if not s.reused]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from .errors import TandemError

PREDICTOR_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class PrepareSettings:
    """What ``tandem prepare`` takes; ``out`` defaults to ``profiles/<model-id>``."""

    model: str
    hardware: str | None = None  # preset or JSON file; None: probe this machine once
    gpu_budget: str | None = None  # e.g. "2GiB"; None: the GPU's free memory (0 without a GPU)
    out: str | None = None
    predictors: str = "auto"  # auto: train for ReLU-family models only
    tokens: int | None = None
    max_quality_loss: float = 0.02
    calib: tuple[str, ...] | None = None
    threads: int | None = None
    measure_quality: bool = True  # record the plan's held-out quality through its runtime

    def __post_init__(self) -> None:
        if self.predictors not in PREDICTOR_CHOICES:
            raise TandemError(f"predictors must be one of {', '.join(PREDICTOR_CHOICES)}, got {self.predictors!r}")
        if self.tokens is not None and self.tokens < 16:
            raise TandemError(f"tokens must be at least 16, got {self.tokens}")
        if not 0.0 < self.max_quality_loss <= 1.0:
            raise TandemError(f"max_quality_loss must be in (0, 1], got {self.max_quality_loss}")
        if self.threads is not None and self.threads < 1:
            raise TandemError(f"threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class StepResult:
    name: str  # "profile" | "train-predictors" | "probe" | "plan"
    path: Path
    reused: bool


@dataclass(frozen=True)
class PrepareResult:
    model_id: str
    profile_dir: Path
    predictors_dir: Path | None
    hardware_path: str  # a preset name or a JSON file
    plan_dir: Path
    steps: tuple[StepResult, ...] = field(default_factory=tuple)


def _command(register: Callable, name: str, values: dict[str, Any]) -> tuple[Callable, argparse.Namespace]:
    """The handler of subcommand ``name`` and its options: the parser's defaults, then ``values``."""
    parser = argparse.ArgumentParser(add_help=False)
    register(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices[name]  # argparse keeps its subparsers here
    options = {a.dest: a.default for a in sub._actions if a.dest != "help"}
    unknown = set(values) - set(options)
    if unknown:
        raise TandemError(f"`tandem {name}` has no option(s) {', '.join(sorted(unknown))}")
    options.update(values)
    namespace = argparse.Namespace(**options)
    handler = getattr(namespace, "handler", None) or sub.get_default("handler") or sub.get_default("func")
    return handler, namespace


def _run(register: Callable, name: str, **values: Any) -> None:
    handler, namespace = _command(register, name, values)
    code = int(handler(namespace) or 0)
    if code != 0:
        raise TandemError(f"`tandem {name}` failed (exit code {code})")


def profile(model: str, out: Path, *, tokens: int | None = None, calib: tuple[str, ...] | None = None,
            max_quality_loss: float = 0.02, threads: int | None = None) -> Path:
    """Profile ``model`` into ``out`` (``tandem profile``); returns ``out``."""
    from offline.cli import add_parsers
    _run(add_parsers, "profile", model=model, out=str(out), tokens=tokens, calib=list(calib) if calib else None,
         max_quality_loss=max_quality_loss, threads=threads)
    return Path(out)


def train_predictors(model: str, profile_dir: Path, out: Path, *, threads: int | None = None) -> Path:
    """Train predictors from a profile into ``out`` (``tandem train-predictors``); returns ``out``."""
    from predictors.cli import add_parsers
    _run(add_parsers, "train-predictors", model=model, profile=str(profile_dir), out=str(out), threads=threads)
    return Path(out)


def probe(out: Path, *, threads: int | None = None) -> Path:
    """Measure this machine into the hardware JSON ``out`` (``tandem probe``); returns ``out``."""
    from placement.cli import add_parsers
    _run(add_parsers, "probe", out=str(out), threads=threads)
    return Path(out)


def plan(model: str, profile_dir: Path, hardware: str, out: Path, *, gpu_budget: str | None = None,
         predictors_dir: Path | None = None, replan: bool = False, measure_quality: bool = True) -> Path:
    """Plan the placement into ``out`` (``tandem plan``); returns ``out``."""
    from placement.cli import add_parsers
    _run(add_parsers, "plan", model=model, profile=str(profile_dir), hardware=hardware, out=str(out),
         gpu_budget=gpu_budget, predictors=str(predictors_dir) if predictors_dir else None, replan=replan,
         no_quality=not measure_quality)
    return Path(out)


def prepare(settings: PrepareSettings, log: TextIO | None = None) -> PrepareResult:
    """Profile, train predictors (ReLU-family models, or when asked), probe and plan, reusing valid artifacts.

    ``log`` receives the steps' own reports and the reuse notes (default: stdout).
    """
    from online.loading import load_checkpoint
    from . import pipeline_checks as checks

    log = log or sys.stdout
    with contextlib.redirect_stdout(log):
        ckpt = load_checkpoint(settings.model)
        cfg, fingerprint, model_id = ckpt.config, ckpt.fingerprint, ckpt.model_id
        del ckpt
        base = Path(settings.out) if settings.out else Path("profiles") / model_id
        steps: list[StepResult] = []

        profile_dir = base / "profile"
        reused = checks.valid_profile(profile_dir, fingerprint) is not None
        if reused:
            print(f"[prepare] reusing profile {profile_dir}")
        else:
            profile(settings.model, profile_dir, tokens=settings.tokens, calib=settings.calib,
                    max_quality_loss=settings.max_quality_loss, threads=settings.threads)
        steps.append(StepResult("profile", profile_dir, reused))

        predictors_dir = None
        if settings.predictors == "on" or (settings.predictors == "auto" and cfg.ffn_is_relu_sparse):
            predictors_dir = base / "predictors"
            reused = checks.predictors_valid(predictors_dir, fingerprint, profile_dir)
            if reused:
                print(f"[prepare] reusing predictors {predictors_dir}")
            else:
                train_predictors(settings.model, profile_dir, predictors_dir, threads=settings.threads)
            steps.append(StepResult("train-predictors", predictors_dir, reused))

        hardware = settings.hardware
        if hardware is None:
            hardware = str(base / "hardware-probed.json")
            reused = Path(hardware).is_file()
            if reused:
                print(f"[prepare] reusing hardware profile {hardware}")
            else:
                probe(Path(hardware), threads=settings.threads)
            steps.append(StepResult("probe", Path(hardware), reused))

        budget = settings.gpu_budget if settings.gpu_budget is not None else checks.default_budget(hardware)
        plan_dir = base / checks.plan_folder_name(hardware, budget)
        stale = (plan_dir / "plan.json").is_file() and not checks.plan_matches(plan_dir, fingerprint, profile_dir)
        if stale:
            print(f"[prepare] the plan in {plan_dir} is stale (its profile or model changed): planning again")
        plan(settings.model, profile_dir, hardware, plan_dir, gpu_budget=budget, predictors_dir=predictors_dir,
             replan=stale, measure_quality=settings.measure_quality)
        steps.append(StepResult("plan", plan_dir, False))
    return PrepareResult(model_id=model_id, profile_dir=profile_dir, predictors_dir=predictors_dir,
                         hardware_path=hardware, plan_dir=plan_dir, steps=tuple(steps))


__all__ = ["PrepareResult", "PrepareSettings", "StepResult", "plan", "prepare", "probe",
           "profile", "train_predictors"]
