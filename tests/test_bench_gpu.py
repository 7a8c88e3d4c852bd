"""bench/gpu_bench.py runs end to end on the CPU tier (tiny chat model) and labels its rows so."""
from __future__ import annotations

import pytest
from helpers_plans import tiny_profile
from helpers_tiny import build_tiny_chat_model


@pytest.mark.slow  # plans through the CLI in a subprocess (~30 s on 2 busy cores)
def test_gpu_bench_writes_a_cpu_tier_table(tmp_path, monkeypatch):
    from bench.gpu_bench import main
    folder = build_tiny_chat_model(tmp_path / "model")
    profile = tiny_profile(folder, tmp_path)
    out = tmp_path / "gpu.md"
    assert main(["--model", str(folder), "--profile", str(profile), "--gpu-device", "cpu", "--tokens", "2",
                 "--rounds", "1", "--fractions", "0.5", "--out", str(out), "--work", str(tmp_path / "plans")]) == 0
    text = out.read_text()
    assert "CPU tier (no GPU: not GPU numbers)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| CPU only (fused C step, layer offload at 0 bytes)",
                                                 "| dense, all layers + output layer on the GPU (layer offload, 100%)",
                                                 "| layer offload at 50%", "| plan at 50%"]
    assert all(float(r.split(" | ")[2]) > 0 for r in rows)  # measured tok/s


@pytest.mark.slow  # a tiny synthetic model made, profiled, its predictors trained, two plans (~40 s on 2 cores)
def test_sparse_stage_and_interleaved_ab_on_the_cpu_tier(tmp_path, monkeypatch):
    """bench.gpu_sparse_stage stages a tiny 90%-sparse model's plans with predictors for the GPU machine (no step
    caches, a tokenizer-only GGUF, stage.json), and bench.gpu_ab --stage runs plan against layer offload on them."""
    import json
    from bench.gpu_ab import main as ab
    from bench.gpu_sparse_stage import main as stage
    monkeypatch.setenv("TANDEM_STEP_CACHE", "0")  # prepare's CPU plan needs no prepared-step cache here
    out = tmp_path / "stage"
    assert stage(["--shape", "tiny", "--models-dir", str(tmp_path / "models"), "--fractions", "0,0.5", "--out", str(out),
                  "--no-wheel", "--profile-tokens", "512", "--predictor-tokens", "1024"]) == 0
    staged = json.loads((out / "stage.json").read_text())
    assert staged["request"]["shape"] == "tiny" and (out / "tokenizer.gguf").is_file() and (out / "model.sha256").is_file()
    assert sorted(p.name for p in (out / "plans").iterdir()) == ["plan-0", "plan-0.5"]
    assert not list((out / "plans").rglob("step-cache"))  # GiBs at real sizes: never carried
    plan0 = json.loads((out / "plans" / "plan-0" / "plan.json").read_text())
    assert sum(plan0["gpu_bytes_by_kind"].values()) == 0 and plan0["predictors_fingerprint"]
    # the GPU machine synthesizes the model from the tokenizer-only GGUF: a GGUF without tensors, same fields,
    # from which synth writes the byte-identical model (its sha256 is what the machine compares)
    import hashlib
    from synth import SynthSpec, get_shape, synthesize
    from tandem.core.loading.gguf_loader import read_gguf
    from tandem.core.loading.resolve import resolve_model_path
    (stub_header, stub), (_, full) = read_gguf(out / "tokenizer.gguf"), read_gguf(resolve_model_path("smollm2"))
    assert len(stub_header.tensors) == 0 and list(stub) == list(full)  # gguf-py's reader: ~5 s a file here
    assert stub["tokenizer.ggml.tokens"] == full["tokenizer.ggml.tokens"] and stub["tokenizer.ggml.merges"] == full["tokenizer.ggml.merges"]
    r = staged["request"]
    again = synthesize(SynthSpec(get_shape("tiny"), sparsity=r["sparsity"], hot_share=r["hot_share"]),
                       tmp_path / "again", str(out / "tokenizer.gguf"))
    assert hashlib.sha256(again.path.read_bytes()).hexdigest() == (out / "model.sha256").read_text().strip()
    table = tmp_path / "ab.md"
    assert ab(["--stage", str(out), "--fractions", "0,0.5", "--rounds", "1", "--tokens", "2", "--threads", "1",
               "--out", str(table)]) == 0
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table.read_text().splitlines()
            if line.startswith("| ") and "---" not in line and not line.startswith("| engine")}
    assert list(rows) == ["CPU only", "plan 0", "layer offload 0.5", "plan 0.5"]
    assert rows["plan 0"][3] == "fused" and float(rows["plan 0"][7].rstrip(" |")) > 0.5  # predictors skip rows
    import torch
    assert ("CPU tier" in table.read_text()) != torch.cuda.is_available()
