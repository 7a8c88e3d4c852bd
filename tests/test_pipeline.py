"""tandem.pipeline: prepare builds profile + plan once, reuses them, replans a stale plan; the CLI
prints the plan folder alone with --print-plan-path."""
from __future__ import annotations

import pytest

from helpers_tiny import build_tiny_chat_model
from tandem import pipeline
from tandem.core.errors import TandemError


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("pipeline") / "model")


def _prepare(folder, out, log=None):
    return pipeline.prepare(folder, out=out, hardware="cpu-only", tokens=600, progress=False,
                            log=log if log is not None else (lambda line: None))


def test_prepare_builds_reuses_and_replans_stale(tiny_folder, tmp_path):
    from offline.profile_artifact import load_profile
    from tandem.core.loading import load_checkpoint
    from placement.plan import load_plan

    out = tmp_path / "art"
    first = _prepare(tiny_folder, out)
    assert not first.profile.reused and not first.plan.reused and first.predictors is None  # SwiGLU: exact path
    assert first.plan.path == out / "plan-cpu-only-0" and first.hardware_path.name == "cpu-only"
    # the artifacts on disk, checked through the stages' own loaders against a fresh checkpoint
    fingerprint = load_checkpoint(tiny_folder).fingerprint
    on_disk_profile = load_profile(first.profile.path, expected_model_fingerprint=fingerprint)
    assert on_disk_profile.fingerprint == first.profile.profile.fingerprint
    on_disk_plan = load_plan(first.plan.path, model_fingerprint=fingerprint, profile_fingerprint=on_disk_profile.fingerprint)
    assert on_disk_plan.gpu_budget_bytes == 0 and on_disk_plan.model_fingerprint == fingerprint
    plan_mtime = (first.plan.path / "plan.json").stat().st_mtime_ns

    lines: list[str] = []
    second = _prepare(tiny_folder, out, lines.append)
    assert second.profile.reused and second.plan.reused and second.plan.path == first.plan.path
    assert (first.plan.path / "plan.json").stat().st_mtime_ns == plan_mtime
    assert any(line.startswith("[prepare] reusing profile") for line in lines)

    pipeline.profile(tiny_folder, out=first.profile.path, tokens=300, search_steps=2, progress=False)
    lines.clear()
    third = _prepare(tiny_folder, out, lines.append)  # the new profile makes the old plan stale
    assert third.profile.reused and not third.plan.reused
    assert any("is stale" in line for line in lines)
    new_profile = load_profile(first.profile.path)
    assert load_plan(third.plan.path, model_fingerprint=fingerprint,
                     profile_fingerprint=new_profile.fingerprint).profile_fingerprint == new_profile.fingerprint


def test_cli_prepare_prints_plan_path_alone(tiny_folder, tmp_path, capsys):
    from tandem.cli import main
    out = tmp_path / "art"
    argv = ["prepare", "--model", str(tiny_folder), "--out", str(out), "--hardware", "cpu-only", "--tokens", "600",
            "--print-plan-path"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{out / 'plan-cpu-only-0'}\n"
    assert "[prepare] plan ready:" in captured.err and (out / "plan-cpu-only-0" / "plan.json").is_file()
    assert main(argv[:-1]) == 0  # without the flag: progress and the plan line on stdout
    printed = capsys.readouterr().out
    assert "[prepare] reusing profile" in printed and f"[prepare] plan ready: {out / 'plan-cpu-only-0'}" in printed


def test_prepare_rejects_bad_predictors_mode(tiny_folder, tmp_path):
    with pytest.raises(TandemError, match="predictors must be auto, on or off"):
        pipeline.prepare(tiny_folder, out=tmp_path, predictors="sometimes")


def test_prepare_leaves_the_step_cache_generate_looks_up(tiny_folder, tmp_path):
    """prepare writes the prepared-step cache last (after the plan's quality), under the key a later
    `generate --plan` computes: the first load reads it (no module graph built) and does not rewrite it."""
    from online import Engine
    from online.engine_args import EngineArgs
    from online.engine_cache import load_cached
    lines = []
    result = _prepare(tiny_folder, tmp_path / "prep", lines.append)
    plan_dir = result.plan.path
    files = sorted((plan_dir / "step-cache").glob("*.safetensors"))
    assert len(files) == 1 and any(str(files[0]) in line for line in lines)
    inode = files[0].stat().st_ino
    assert load_cached(EngineArgs.create(str(tiny_folder), plan=str(plan_dir))) is not None
    engine = Engine.load(str(tiny_folder), plan=str(plan_dir))
    assert engine._model is None  # served from the cache
    assert files[0].stat().st_ino == inode  # read, not rewritten
