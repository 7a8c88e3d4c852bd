"""`--speculate` / `--draft-tokens` on generate and perplexity: exact results, stats, one-line errors."""
from __future__ import annotations

import json

import pytest

from helpers_tiny import build_tiny_chat_model
from tandem.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(build_tiny_chat_model(tmp_path_factory.mktemp("spec_cli")))


def test_generate_json_reports_speculation_and_matches_plain(capsys, chat_model):
    common = ["generate", "--model", chat_model, "--prompt", "hello", "--max-new-tokens", "24", "--ignore-eos",
              "--weight-format", "int4", "--json"]
    code, out, _ = run_cli(capsys, *common)
    plain = json.loads(out)
    code, out, _ = run_cli(capsys, *common, "--speculate", "lookup", "--draft-tokens", "4")
    spec = json.loads(out)
    assert code == 0 and spec["token_ids"] == plain["token_ids"]
    for key in ("speculate", "acceptance_rate", "tokens_per_verify_step", "draft_time_share", "draft_tokens"):
        assert key in spec
    assert spec["speculate"] == "lookup"


def test_perplexity_k_tokens_per_step_equals_the_one_token_decode_path(capsys, chat_model, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 6)
    common = ["perplexity", "--model", chat_model, "--text-file", str(text), "--weight-format", "int4", "--json",
              "--window", "32", "--stride", "16"]
    _, out, _ = run_cli(capsys, *common, "--decode-steps")
    one = json.loads(out)
    _, out, _ = run_cli(capsys, *common, "--speculate", "lookup", "--draft-tokens", "5")
    many = json.loads(out)
    assert many["tokens_per_step"] == 5 and many["perplexity"] == one["perplexity"]


@pytest.mark.parametrize("extra,fragment", [(["--speculate", "fast"], "--speculate must be one of"),
                                             (["--speculate", "lookup", "--draft-tokens", "0"], "--draft-tokens"),
                                             (["--draft-tokens", "3"], "needs --speculate")])
def test_bad_speculation_flags_are_one_line_errors(capsys, chat_model, extra, fragment):
    code, _, err = run_cli(capsys, "generate", "--model", chat_model, "--prompt", "hi", *extra)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and fragment in lines[0]


def test_serve_rejects_a_bad_speculate_value_before_loading(capsys, tmp_path):
    code, _, err = run_cli(capsys, "serve", "--model", str(tmp_path / "absent.gguf"), "--speculate", "fast",
                           "--port", "8123")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--speculate must be one of" in lines[0]


def test_engine_default_speculation_applies_to_calls_that_pass_none(chat_model):
    from online import Engine
    engine = Engine.load(chat_model, weight_format="int4")
    plain = engine.generate("hello", max_new_tokens=16, ignore_eos=True)
    assert engine.set_default_speculation("lookup", 3) == {"speculate": "lookup"}
    got = engine.generate("hello", max_new_tokens=16, ignore_eos=True)
    assert got.stats["speculate"] == "lookup" and got.token_ids == plain.token_ids
    modules = Engine.load(chat_model, weight_format="int4", fused_decode=False)
    shown = modules.set_default_speculation("auto")
    assert shown["speculate"] == "off" and "fused decode step" in shown["speculate_reason"]


def test_a_mode_asked_for_by_name_that_cannot_run_is_an_error_and_auto_falls_back(capsys, chat_model, tmp_path):
    """generate and perplexity used to fall back to plain decoding for `--speculate lookup|sparse` on an engine
    without the fused step (the dense default) and say so only after the run; tandem serve refuses them. Now both
    refuse before the work; `auto` still falls back and says why (reference: the plain run's tokens)."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 4)
    for command in (["generate", "--prompt", "hello", "--max-new-tokens", "6"],
                    ["perplexity", "--text-file", str(text), "--window", "16"]):
        for mode in ("lookup", "sparse"):
            code, out, err = run_cli(capsys, command[0], "--model", chat_model, *command[1:], "--speculate", mode)
            lines = [line for line in err.splitlines() if line.strip()]
            assert (code, out, len(lines)) == (2, "", 1) and f"--speculate {mode}: " in lines[0], (command, mode)
            assert "fused decode step" in lines[0]
    common = ["generate", "--model", chat_model, "--prompt", "hello", "--max-new-tokens", "6", "--ignore-eos", "--json"]
    _, out, _ = run_cli(capsys, *common)
    code, auto_out, _ = run_cli(capsys, *common, "--speculate", "auto")
    auto = json.loads(auto_out)
    assert code == 0 and auto["token_ids"] == json.loads(out)["token_ids"]
    assert auto["speculate"] == "off" and "fused decode step" in auto["speculate_reason"]
