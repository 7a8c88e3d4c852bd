"""Bad input through `tandem generate` / `tandem perplexity`: one line on stderr, exit code 2, no traceback."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, fragment: str) -> None:
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and fragment in lines[0], lines[0]
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def test_missing_model_file(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi")
    assert_one_line_error(code, err, "model not found")


def test_truncated_gguf(capsys, tmp_path, smollm2_path):
    broken = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as f:
        broken.write_bytes(f.read(3_000_000))
    code, _, err = run_cli(capsys, "generate", "--model", str(broken), "--prompt", "hi")
    assert_one_line_error(code, err, "")


def test_garbage_gguf(capsys, tmp_path):
    broken = tmp_path / "garbage.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    code, _, err = run_cli(capsys, "generate", "--model", str(broken), "--prompt", "hi")
    assert_one_line_error(code, err, "")


def test_corrupted_safetensors_header(capsys, tmp_path, tiny_llama):
    from pathlib import Path
    src = Path(tiny_llama)
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    data = bytearray((src / "model.safetensors").read_bytes())
    data[8:40] = b"{not json at all!!" + b" " * 14
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt-ids", "1,2")
    assert_one_line_error(code, err, "corrupted safetensors")


def test_unknown_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "rwkv", "vocab_size": 10}))
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt-ids", "1")
    assert_one_line_error(code, err, "unsupported model_type 'rwkv'")


def test_empty_prompt(capsys, tiny_llama):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt", "")
    assert_one_line_error(code, err, "prompt is empty")


def test_prompt_longer_than_context(capsys, tiny_llama):
    ids = ",".join(["5"] * 200)  # the tiny model's context is 128
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt-ids", ids)
    assert_one_line_error(code, err, "context holds 128")


@pytest.mark.parametrize("flag,value,fragment", [
    ("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"), ("--top-p", "1.5", "top_p"),
    ("--top-k", "-3", "top_k"), ("--max-new-tokens", "0", "max_new_tokens"), ("--seed", "-1", "seed"),
    ("--temperature", "nan", "temperature"),
])
def test_invalid_sampling_values(capsys, tiny_llama, flag, value, fragment):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt-ids", "1,2", flag, value)
    assert_one_line_error(code, err, fragment)


def test_text_prompt_without_tokenizer(capsys, tiny_llama):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt", "hello")
    assert_one_line_error(code, err, "no tokenizer")


def test_bad_prompt_ids(capsys, tiny_llama):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt-ids", "1,x")
    assert_one_line_error(code, err, "--prompt-ids")
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt-ids", "1,99999")
    assert_one_line_error(code, err, "out of range")


def test_argparse_errors_are_one_line(capsys, tiny_llama):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", tiny_llama])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_perplexity_missing_text_file(capsys, tiny_llama, tmp_path):
    code, _, err = run_cli(capsys, "perplexity", "--model", tiny_llama, "--text-file", str(tmp_path / "x.txt"))
    assert_one_line_error(code, err, "text file not found")


def test_generate_json_and_prompt_ids(capsys, tiny_llama, tiny_model_dir):
    import torch
    _, hf_model = tiny_model_dir("llama")
    code, out, _ = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt-ids", "3,4,5",
                           "--max-new-tokens", "6", "--json")
    assert code == 0
    record = json.loads(out)
    for key in ("text", "token_ids", "prompt_tokens", "generated_tokens", "ttft_s", "decode_tokens_per_s"):
        assert key in record
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert record["token_ids"] == ref[: len(record["token_ids"])]
    assert record["prompt_tokens"] == 3


def test_subprocess_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "--model", str(tmp_path / "x.gguf"),
                           "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr
