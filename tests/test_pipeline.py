"""tandem.pipeline: steps as functions with typed results; `tandem prepare --print-plan-path` for scripts."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.errors import TandemError
from tandem.pipeline import PrepareSettings, _command, prepare

PROFILES = Path("profiles/SmolLM2-135M-Instruct.Q4_1")


def test_settings_are_validated():
    with pytest.raises(TandemError, match="predictors"):
        PrepareSettings(model="smollm2", predictors="maybe")
    with pytest.raises(TandemError, match="tokens"):
        PrepareSettings(model="smollm2", tokens=3)
    with pytest.raises(TandemError, match="max_quality_loss"):
        PrepareSettings(model="smollm2", max_quality_loss=0.0)


def test_step_options_are_the_commands_defaults_plus_the_values_given():
    from placement.cli import add_parsers, cmd_plan
    handler, ns = _command(add_parsers, "plan", {"model": "m", "profile": "p", "hardware": "h", "out": "o"})
    assert handler is cmd_plan
    assert (ns.model, ns.time_limit, ns.replan, ns.weight_format) == ("m", 30.0, False, "auto")
    with pytest.raises(TandemError, match="no option"):
        _command(add_parsers, "plan", {"no_such_option": 1})


@pytest.fixture()
def prepared_copy(tmp_path):
    if not (PROFILES / "profile").is_dir() or not (PROFILES / "hardware-probed.json").is_file():
        pytest.skip("needs the SmolLM2 profile and hardware JSON from `make run`")
    out = tmp_path / "arts"
    shutil.copytree(PROFILES, out, ignore=shutil.ignore_patterns("plan-*", "predictors"))
    return out


def test_prepare_reuses_valid_artifacts_and_names_the_plan(prepared_copy, capsys):
    result = prepare(PrepareSettings(model="smollm2", out=str(prepared_copy), predictors="off"))
    assert result.plan_dir == prepared_copy / "plan-probed-0" and (result.plan_dir / "plan.json").is_file()
    assert [(s.name, s.reused) for s in result.steps] == [("profile", True), ("probe", True), ("plan", False)]
    assert result.predictors_dir is None and result.profile_dir == prepared_copy / "profile"
    assert "reusing profile" in capsys.readouterr().out


def test_print_plan_path_prints_only_the_plan_folder(prepared_copy):
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "prepare", "--model", "smollm2", "--out",
                           str(prepared_copy), "--predictors", "off", "--print-plan-path"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{prepared_copy / 'plan-probed-0'}\n"
    assert "reusing profile" in done.stderr
