"""Where the CLI writes and what it checks before working: an artifact never replaces a user's files, an
output that cannot be written fails before the model loads, values nothing would read are refused, and
perplexity scores every window the brute-force rule says (a last window of one token once crashed it).

References: the user's files themselves (still there, byte for byte), the order of the errors (the output
check names the path even where the model does not exist, so it ran first), and a hand count of the
sliding windows' scored tokens with the engine's own logits."""
from __future__ import annotations

import math
import os
import stat

import pytest
import torch

from helpers_tiny import build_tiny_chat_model
from tandem import pipeline
from tandem.cli import main
from tandem.core.artifacts import check_artifact_out, save_artifact, umask_mode
from tandem.core.errors import ArtifactError


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("cli-outputs") / "model")


@pytest.fixture(scope="module")
def prepared(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    result = pipeline.prepare(tiny_folder, out=out, hardware="cpu-only", tokens=600, progress=False,
                              log=lambda line: None)
    return result


def one_line_error(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def test_an_artifact_never_replaces_other_files(tmp_path, capsys, prepared, tiny_folder):
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("important")
    lone = tmp_path / "notes.md"
    lone.write_text("also important")
    for out in (user, lone):
        with pytest.raises(ArtifactError):
            save_artifact(out, "plan", {"x": torch.zeros(1)}, {"kind": "plan"})
        line = one_line_error(capsys, "plan", "--model", str(tiny_folder), "--profile", str(prepared.profile.path),
                              "--hardware", "cpu-only", "--no-quality", "--out", str(out))
        assert str(out) in line
    assert (user / "notes.txt").read_text() == "important" and (user / "sub").is_dir()
    assert lone.read_text() == "also important"
    # an artifact's folder that holds the user's files too (or prepare's nested artifacts) is not replaced either:
    # profile --out used to delete them, as only profile.json was looked for
    shared = tmp_path / "shared"
    save_artifact(shared, "plan", {"x": torch.zeros(1)}, {"kind": "plan"})
    (shared / "step-cache").mkdir()
    assert check_artifact_out(shared, "plan") == shared  # its own files and its step cache: replaced
    (shared / "NOTES.md").write_text("mine")
    (shared / "plan-mine").mkdir()
    with pytest.raises(ArtifactError, match="NOTES.md, plan-mine"):
        save_artifact(shared, "plan", {"x": torch.zeros(1)}, {"kind": "plan"})
    assert (shared / "NOTES.md").read_text() == "mine" and (shared / "plan.json").is_file()
    # an existing artifact of the same name is replaced (the documented overwrite), an empty folder filled
    (tmp_path / "empty").mkdir()
    for out in (prepared.plan.path, tmp_path / "empty"):
        assert check_artifact_out(out, "plan") == out
    written = save_artifact(tmp_path / "fresh", "plan", {"x": torch.zeros(1)}, {"kind": "plan"})
    assert stat.S_IMODE(os.stat(written).st_mode) == umask_mode(0o777)  # not mkdtemp's private 0700
    assert stat.S_IMODE(os.stat(written / "plan.json").st_mode) == umask_mode(0o666)


def test_outputs_are_checked_before_the_model_loads(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    missing_model = str(tmp_path / "no-such-model.gguf")
    for argv in (["profile", "--model", missing_model, "--out", str(blocker / "profile")],
                 ["train-predictors", "--model", missing_model, "--profile", str(tmp_path),
                  "--out", str(blocker / "preds")],
                 ["prepare", "--model", missing_model, "--out", str(blocker)],
                 ["probe", "--out", str(blocker / "hw.json")],
                 ["probe", "--fused", str(tmp_path)]):
        line = one_line_error(capsys, *argv)
        assert "cannot write" in line and "no-such-model" not in line, (argv, line)
    line = one_line_error(capsys, "prepare", "--model", missing_model, "--gpu-budget", "2XB")
    assert "2XB" in line


def test_values_nothing_would_read_are_refused(capsys, prepared, tiny_folder, tmp_path):
    plan, model = str(prepared.plan.path), str(tiny_folder)
    cases = [
        (["generate", "--model", model, "--prompt", "hi", "--predictors", str(tmp_path)], "needs plan"),
        (["generate", "--model", model, "--prompt", "hi", "--profile", str(tmp_path)], "needs plan"),
        (["generate", "--model", model, "--plan", plan, "--prompt", "hi", "--predictors", str(tmp_path)],
         "without predictors"),
        (["show-plan", plan, "--threads", "2"], "--measure"),
        (["show-plan", plan, "--plot", str(tmp_path / "split.txt")], ".png"),
        (["plan", "--model", model, "--profile", str(prepared.profile.path), "--hardware", "cpu-only",
          "--no-quality", "--out", str(tmp_path / "p"), "--context", "0"], "context"),
        (["generate", "--model", model, "--prompt", "hi", "--threads", str(10**5)], "threads"),
        (["generate", "--model", model, "--prompt", "hi", "--seed", str(2**64)], "seed"),
        (["generate", "--model", model, "--prompt-ids", "1,,2"], "prompt-ids"),
        (["generate", "--model", model, "--prompt", "caf\udcc3"], "UTF-8"),
        (["prepare", "--model", model, "--out", str(prepared.plan.path.parent), "--tokens", "0"], "--tokens"),
    ]
    for argv, fragment in cases:
        assert fragment in one_line_error(capsys, *argv), argv
    assert not (tmp_path / "p").exists()


def test_perplexity_scores_each_window_once_down_to_a_last_token(tiny_folder, tmp_path, capsys):
    """Windows of W tokens every W tokens over k W + 1 tokens: the last window holds one token and nothing
    to score. The reference scores each window by hand from the engine's logits."""
    from online import Engine
    engine = Engine.load(str(tiny_folder))
    text = " ".join(f"w{i % 17}" for i in range(300))
    ids = engine.encode_prompt_for_scoring(text)
    window = 16
    ids = ids[:(len(ids) - 1) // window * window + 1]  # k windows and one token
    nll, scored = 0.0, 0
    for begin in range(0, len(ids) - 1, window):
        chunk = ids[begin:begin + window]
        logp = torch.log_softmax(engine.logits(chunk).double(), dim=-1)  # [W, vocab]
        nll -= sum(float(logp[i, chunk[i + 1]]) for i in range(len(chunk) - 1))
        scored += len(chunk) - 1
    ppl, got_scored = engine.perplexity(ids, window_tokens=window, stride_tokens=window)
    assert got_scored == scored and math.isclose(ppl, math.exp(nll / scored), rel_tol=1e-9)
    path = tmp_path / "text.txt"
    path.write_text(text)
    assert main(["perplexity", "--model", str(tiny_folder), "--text-file", str(path), "--window", "2"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert "--stride" in one_line_error(capsys, "perplexity", "--model", str(tiny_folder), "--text-file", str(path),
                                        "--window", "8", "--stride", "9")



def test_an_edited_artifact_is_refused_whichever_field_changed(prepared, tiny_folder, tmp_path, capsys):
    """The kinds' fingerprints cover what later stages compare; a plan's output_head_on_gpu or a profile layer's
    sparsity were outside them, so an edit changed what ran (or crashed show-profile with a traceback). The
    content checksum refuses any edit; the same metadata in other bytes (indentation) still loads."""
    import json
    import shutil
    from offline.profile_artifact import load_profile
    from placement.plan import read_plan
    edits = {"plan": lambda m: m.update(output_head_on_gpu=True),
             "profile": lambda m: m["layers"][1].update(sparsity="abc")}
    for name, edit in edits.items():
        source = prepared.plan.path if name == "plan" else prepared.profile.path
        copy = tmp_path / name
        shutil.copytree(source, copy)
        meta = json.loads((copy / f"{name}.json").read_text())
        (copy / f"{name}.json").write_text(json.dumps(meta, indent=1))  # same content, other bytes: loads
        (read_plan if name == "plan" else load_profile)(copy)
        edit(meta)
        (copy / f"{name}.json").write_text(json.dumps(meta))
        with pytest.raises(ArtifactError, match="corrupted or was edited"):
            (read_plan if name == "plan" else load_profile)(copy)
        line = one_line_error(capsys, f"show-{name}", str(copy))
        assert "corrupted or was edited" in line


def test_a_folder_refused_as_a_plan_is_left_as_it_was(tiny_folder, tmp_path, capsys):
    """The step cache's folder was made inside --plan before the plan was read: a refused folder kept an empty
    step-cache/ (reference: the folder's listing before the call)."""
    folder = tmp_path / "not-a-plan"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    line = one_line_error(capsys, "generate", "--model", str(tiny_folder), "--plan", str(folder), "--prompt", "hi")
    assert "not a plan" in line and sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_probe_refuses_threads_past_the_cap_and_one_file_for_two_outputs(tmp_path, capsys):
    """probe recorded --threads 1000 on a 2-CPU machine (plans then run with it), and --out F --fused F let the
    calibration replace the hardware profile; both are refused before the probe's minute of measuring."""
    from tandem.core.cpus import usable_cpus
    line = one_line_error(capsys, "probe", "--threads", str(8 * usable_cpus() + 1))
    assert f"at most {8 * usable_cpus()}" in line  # (the engines' cap, written out: the reference)
    line = one_line_error(capsys, "probe", "--out", str(tmp_path / "hw.json"),
                          "--fused", str(tmp_path / "." / "hw.json"))
    assert "same file" in line and not (tmp_path / "hw.json").exists()
