"""A plan is reused only when it answers what the run asks for: `plan` / `prepare` measure a reused plan's
quality when it lacks it (an interrupted measurement leaves the plan marked pending, never "planned with
--no-quality"); `prepare --replan` replaces a plan made for other hardware; `prepare` checks its hardware and
budget before profiling; `prepare --tokens` caps predictor training too. The quality measurement is replaced
by a stand-in (raising KeyboardInterrupt where a run is interrupted): these tests are about what is kept."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from helpers_plans import tiny_profile
from helpers_tiny import build_tiny_chat_model
from tandem import pipeline
from tandem.cli import main
from tandem.core.errors import TandemError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("reuse")
    folder = build_tiny_chat_model(base / "model")
    return folder, tiny_profile(folder, base)


@pytest.fixture
def measured(monkeypatch):
    """The quality measurement's stand-in: records the tokens asked for; ``interrupt[0]`` makes it raise."""
    import online.plan_measure
    calls: list[int] = []
    interrupt = [False]

    def measure(model, plan_dir, *, max_tokens, gpu_device=None, max_quality_loss=None, **_):
        calls.append(max_tokens)
        if interrupt[0]:
            raise KeyboardInterrupt
        return {"label": "measured", "held_out_tokens": max_tokens - 1, "requested_tokens": max_tokens,
                "perplexity": 10.0, "dense_perplexity": 10.0, "perplexity_increase": 0.0, "greedy_agreement": 1.0,
                "max_quality_loss": max_quality_loss, "window_tokens": 16, "tier_device": "cpu", "path": "stand-in"}
    monkeypatch.setattr(online.plan_measure, "measure_plan_quality", measure)
    return calls, interrupt


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_an_interrupted_measurement_is_finished_by_the_next_plan(tiny, tmp_path, measured, capsys):
    from placement.plan import read_plan
    folder, profile = tiny
    calls, interrupt = measured
    out = tmp_path / "plan"
    argv = ["plan", "--model", folder, "--profile", profile, "--hardware", "cpu-only", "--out", out, "--context", 64]
    interrupt[0] = True
    assert _run(capsys, *argv)[0] == 130 and calls == [256]  # stopped while measuring
    shown = _run(capsys, "show-plan", out)[1]
    assert "quality: not measured (the measurement did not finish" in shown and "--no-quality)" not in shown
    left = read_plan(out)
    assert left.quality == {} and left.quality_status == "pending"
    interrupt[0] = False
    code, printed, _ = _run(capsys, *argv)  # reuses the plan and measures it
    assert code == 0 and calls == [256, 256]
    assert "reusing the plan" in printed and "measuring the quality of the plan" in printed
    assert read_plan(out).quality["requested_tokens"] == 256 and "quality (measured" in printed
    code, printed, _ = _run(capsys, *argv)  # measured: plain reuse
    assert code == 0 and calls == [256, 256] and "measuring" not in printed


def test_a_no_quality_plan_is_measured_when_a_run_wants_quality(tiny, tmp_path, measured, capsys):
    from placement.plan import read_plan
    folder, profile = tiny
    calls, _ = measured
    out = tmp_path / "plan"
    argv = ["plan", "--model", folder, "--profile", profile, "--hardware", "cpu-only", "--out", out, "--context", 64]
    code, printed, _ = _run(capsys, *argv, "--no-quality")
    assert code == 0 and calls == [] and "quality: not measured (planned with --no-quality)" in printed
    assert "quality: not measured (planned with --no-quality)" in _run(capsys, "show-plan", out)[1]
    assert _run(capsys, *argv, "--quality-tokens", 32, "--gpu-device", "cpu")[0] == 0 and calls == [32]
    assert read_plan(out).quality["requested_tokens"] == 32
    for again in ([], ["--no-quality"], ["--quality-tokens", 32], ["--gpu-device", "cpu"]):  # answered: no new run
        assert _run(capsys, *argv, *again)[0] == 0 and calls == [32], again
    assert _run(capsys, *argv, "--quality-tokens", 64)[0] == 0 and calls == [32, 64]  # asked on other tokens


def _prepare_dir(tiny, tmp_path):
    """A prepare folder holding the tiny profile (reused, as a real one is), and a probed hardware file."""
    from placement.hardware import PRESETS, save_hardware
    out = tmp_path / "art"
    shutil.copytree(tiny[1], out / "profile")
    save_hardware(dataclasses.replace(PRESETS["cpu-only"], name="probed"), out / "hardware-probed.json")
    return out


def test_prepare_measures_a_plan_left_unmeasured(tiny, tmp_path, measured):
    from placement.plan import read_plan
    calls, interrupt = measured
    out = _prepare_dir(tiny, tmp_path)
    interrupt[0] = True
    with pytest.raises(KeyboardInterrupt):
        pipeline.prepare(tiny[0], out=out, progress=False)
    plan_dir = out / "plan-probed-0"
    interrupt[0] = False
    lines: list[str] = []
    result = pipeline.prepare(tiny[0], out=out, progress=False, log=lines.append)
    assert result.plan.reused and calls == [256, 256] and read_plan(plan_dir).quality["perplexity"] == 10.0
    assert any(line.startswith("[prepare] measuring the quality of the plan") for line in lines)
    shutil.rmtree(plan_dir)
    pipeline.prepare(tiny[0], out=out, progress=False, quality=False)
    assert read_plan(plan_dir).quality == {} and calls == [256, 256]
    assert pipeline.prepare(tiny[0], out=out, progress=False).plan.reused and calls == [256, 256, 256]


def test_prepare_replans_for_new_hardware_when_told(tiny, tmp_path, capsys):
    from placement.hardware import load_hardware, save_hardware
    from placement.plan import read_plan
    out = _prepare_dir(tiny, tmp_path)
    argv = ["prepare", "--model", tiny[0], "--out", out, "--no-quality"]
    assert _run(capsys, *argv)[0] == 0
    probed = load_hardware(out / "hardware-probed.json")  # the machine measured again: other figures
    save_hardware(dataclasses.replace(probed, cpu_bandwidth_bytes_per_s=2 * probed.cpu_bandwidth_bytes_per_s),
                  out / "hardware-probed.json")
    code, _, err = _run(capsys, *argv)
    assert code == 2 and "made for other hardware" in err and "run `tandem prepare` again (with --replan" in err
    assert _run(capsys, *argv, "--replan")[0] == 0
    fingerprint = load_hardware(out / "hardware-probed.json").fingerprint
    assert read_plan(out / "plan-probed-0").hardware.fingerprint == fingerprint != probed.fingerprint


@pytest.mark.parametrize("extra, message", [
    (["--hardware", "nope"], "unknown hardware 'nope'"),
    (["--hardware", "{garbage}"], "cannot read hardware profile"),
    (["--hardware", "cpu-only", "--gpu-budget", "1GiB"], "has no GPU"),
    (["--hardware", "rtx4090", "--gpu-budget", "1KiB"], "too small for the GPU tier's buffers"),
    (["--hardware", "cpu-only", "--predictors", "on", "--tokens", "20"], "at least 64 to train predictors"),
])
def test_prepare_checks_hardware_and_budget_before_any_work(tiny, tmp_path, monkeypatch, capsys, extra, message):
    def no_work(*_, **__):
        raise AssertionError("prepare started working before checking its inputs")
    monkeypatch.setattr(pipeline, "_load_engine", no_work)
    monkeypatch.setattr(pipeline, "profile", no_work)
    monkeypatch.setattr(pipeline, "probe", no_work)
    garbage = tmp_path / "hw.json"
    garbage.write_text("not json")
    extra = [str(garbage) if a == "{garbage}" else a for a in extra]
    code, _, err = _run(capsys, "prepare", "--model", tiny[0], "--out", tmp_path / "art", *extra)
    assert code == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "art" / "profile").exists()


def test_prepare_trains_predictors_on_its_tokens(tiny, tmp_path, monkeypatch):
    asked = {}

    class Stop(Exception):
        pass

    def train(model, profile_dir, **kwargs):
        asked.update(kwargs)
        raise Stop
    monkeypatch.setattr(pipeline, "_load_engine", lambda *_: object())
    monkeypatch.setattr(pipeline, "train_predictors", train)
    with pytest.raises(Stop):
        pipeline.prepare(tiny[0], out=_prepare_dir(tiny, tmp_path), predictors="on", tokens=300, progress=False)
    assert asked["tokens"] == 300
    with pytest.raises(TandemError, match="at least 64 to train predictors"):
        pipeline.prepare(tiny[0], out=tmp_path / "other", predictors="on", tokens=32)
