"""What ``tandem.pipeline.prepare`` checks before it reuses an artifact (valid for this model and inputs).

Example::

    profile = valid_profile(Path("profiles/m/profile"), ckpt.fingerprint)   # None when stale/missing
    plan_folder_name("probed", "0")                                        # "plan-probed-0"
"""
from __future__ import annotations

from pathlib import Path

from .errors import ArtifactError, TandemError


def valid_profile(path: Path, fingerprint: str):
    from offline.profile_artifact import load_profile
    try:
        return load_profile(path, expected_model_fingerprint=fingerprint)
    except ArtifactError:
        return None


def predictors_valid(path: Path, fingerprint: str, profile_dir: Path) -> bool:
    if not (path / "predictors.json").is_file():
        return False
    try:
        from offline.profile_artifact import load_profile
        from predictors.artifact import load_predictors
        profile = load_profile(profile_dir, expected_model_fingerprint=fingerprint)
        load_predictors(path, expected_model_fingerprint=fingerprint, expected_profile_fingerprint=profile.fingerprint)
        return True
    except (ArtifactError, TandemError, ImportError):
        return False


def plan_matches(plan_dir: Path, fingerprint: str, profile_dir: Path) -> bool:
    from placement.plan import load_plan
    profile = valid_profile(profile_dir, fingerprint)
    if profile is None:
        return False
    try:
        load_plan(plan_dir, model_fingerprint=fingerprint, profile_fingerprint=profile.fingerprint)
        return True
    except (ArtifactError, TandemError):
        return False


def default_budget(hardware: str) -> str | None:
    """90% of the GPU's free memory; "0" on a machine profile without a GPU; None: the planner's default."""
    import torch
    if torch.cuda.is_available():
        free_bytes, _ = torch.cuda.mem_get_info()
        return str(int(free_bytes * 0.9))
    from placement.hardware import load_hardware
    return "0" if not load_hardware(hardware).has_gpu else None


def plan_folder_name(hardware: str, budget: str | None) -> str:
    from placement.budget import format_bytes, parse_bytes
    from placement.hardware import load_hardware
    budget_bytes = parse_bytes(budget) if budget is not None else None
    return f"plan-{load_hardware(hardware).name}-{format_bytes(budget_bytes) if budget_bytes is not None else 'default'}"
