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
