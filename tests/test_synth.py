"""tandem synth: requested statistics realised (checked through the engine's own forward), GGUF validity."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from online import Engine
from tandem.core.kv_cache import KVCache
from tandem.core.loading.gguf_loader import read_gguf
from synth import SynthSpec, get_shape, synthesize
from synth.activity import firing_rates, hot_share_of, max_hot_share
from tandem.core.errors import TandemError

TOKENIZER = "models/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny90(tmp_path_factory):
    return synthesize(SynthSpec(get_shape("tiny"), sparsity=0.9), tmp_path_factory.mktemp("syn"), TOKENIZER)


def engine_activity(path, n_seq: int = 6, seq_len: int = 48, seed: int = 1):
    """Per layer [tokens, n_ff] gate > 0 through the engine's float32 module path (independent forward)."""
    engine = Engine.load(str(path))
    cfg, ex = engine.config, engine.executor
    seen: dict[int, list] = {}

    class Recorder:
        def forward(self, layer, x):
            w = ex.layers[layer]
            seen.setdefault(layer, []).append((x @ w.gate.T) > 0)  # [T, n_ff]
            return ex.forward(layer, x)

        def output_logits(self, x, w):
            return ex.output_logits(x, w)

    rng = np.random.default_rng(seed)
    for _ in range(n_seq):
        ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, size=seq_len))
        engine.model(ids, 0, KVCache(cfg, capacity_tokens=seq_len), Recorder())
    return engine, {k: torch.cat(v) for k, v in seen.items()}


def test_firing_rates_hit_mean_and_hot_share():
    for sparsity, share in ((0.9, 0.8), (0.95, 0.8), (0.8, 0.8), (0.5, 0.5)):
        p = firing_rates(4096, sparsity, 0.26, share, np.random.default_rng(0))
        assert abs(p.mean() - (1 - sparsity)) < 1e-6
        assert abs(hot_share_of(p, 0.26) - share) < 1e-3
    with pytest.raises(TandemError, match="at most"):
        firing_rates(4096, 0.5, 0.26, 0.8)
    assert max_hot_share(0.5, 0.26) < 0.8


def test_synth_realises_requested_statistics_in_the_engine(tiny90):
    summary = tiny90.stats["summary"]
    assert summary["within_tolerance"] and summary["synthetic_weights"]
    engine, active = engine_activity(tiny90.path)
    assert engine.config.hidden_act == "relu"
    for layer, a in active.items():  # the engine's own forward on other random tokens
        rates = a.float().mean(0).numpy()
        assert abs(1 - rates.mean() - 0.9) < 0.03, (layer, rates.mean())
        assert abs(hot_share_of(rates, 0.26) - 0.8) < 0.08, layer


def test_synth_gguf_header_carries_stats_and_label(tiny90):
    _, fields = read_gguf(tiny90.path)
    assert fields["general.name"].startswith("synthetic weights")
    assert fields["tandem.activation"] == "relu"
    stats = json.loads(fields["tandem.synth.stats"])
    assert stats["sparsity"] == pytest.approx(tiny90.stats["summary"]["sparsity"])
    side = json.loads(tiny90.path.with_name(tiny90.path.name + ".synth.json").read_text())
    assert side["synthetic_weights"] and len(side["layers"]) == 2
    assert not list(tiny90.path.parent.glob(".*.tmp"))


def test_synth_silu_nearly_equals_relu(tiny90):
    """llama.cpp computes SiLU(gate): strongly negative inactive gates keep it close to ReLU."""
    engine, _ = engine_activity(tiny90.path, n_seq=1)
    w = engine.executor.layers[0]
    x = torch.nn.functional.rms_norm(engine.model.embed_tokens.weight[:256], (engine.config.hidden_size,))
    g, u = x @ w.gate.T, x @ w.up.T
    relu, silu = (torch.relu(g) * u) @ w.down.T, (torch.nn.functional.silu(g) * u) @ w.down.T
    assert float((silu - relu).norm() / relu.norm()) < 0.05


def test_synth_moe_shape_loads(tmp_path):
    res = synthesize(SynthSpec(get_shape("tiny-moe"), sparsity=0.8, sample_seqs=8), tmp_path, TOKENIZER)
    assert res.stats["summary"]["within_tolerance"]
    engine = Engine.load(str(res.path))
    assert engine.config.num_experts == 4 and engine.config.hidden_act == "relu"
    out = engine.generate([1, 2, 3], max_new_tokens=3)
    assert len(out.token_ids) == 3


def test_synth_cli_errors(tmp_path, capsys):
    from tandem.cli import main

    assert main(["synth", "--shape", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert main(["synth", "--shape", "tiny", "--out", str(tmp_path), "--sparsity", "0.5"]) == 2
    assert "--hot-share" in capsys.readouterr().err
    assert main(["synth", "--shape", "tiny", "--out", str(tmp_path), "--qtype", "Q8_0"]) == 2
    assert not list(tmp_path.iterdir())
    (tmp_path / "file").write_text("x")
    assert main(["synth", "--shape", "tiny", "--out", str(tmp_path / "file")]) == 2
    assert "cannot create output directory" in capsys.readouterr().err


def test_readme_pipeline_on_a_synthetic_model_decodes_fused(tiny90, tmp_path, capsys):
    """profile -> train-predictors -> plan -> generate on a synthetic GGUF: the plan has predictors and
    decodes through the fused step, with the same tokens as the module path."""
    from tandem.cli import main

    m, d = str(tiny90.path), tmp_path
    assert main(["profile", "--model", m, "--tokens", "1024", "--no-progress", "--out", str(d / "profile")]) == 0
    assert main(["train-predictors", "--model", m, "--profile", str(d / "profile"), "--out", str(d / "predictors"),
                 "--no-progress", "--tokens", "2048", "--eval-tokens", "512"]) == 0
    assert main(["plan", "--model", m, "--profile", str(d / "profile"), "--predictors", str(d / "predictors"),
                 "--hardware", "cpu-only", "--out", str(d / "plan")]) == 0
    # a plan written away from its profile and predictors: its prepared-step cache is still written (the plan
    # command once exited 2 here, looking for the profile beside the plan)
    assert main(["plan", "--model", m, "--profile", str(d / "profile"), "--predictors", str(d / "predictors"),
                 "--hardware", "cpu-only", "--out", str(d / "elsewhere" / "plan"), "--no-quality"]) == 0
    assert list((d / "elsewhere" / "plan" / "step-cache").glob("step-*.safetensors"))
    capsys.readouterr()
    runs = []
    for extra in ([], ["--no-fused-decode"]):
        assert main(["generate", "--model", m, "--plan", str(d / "plan"), "--predictors", str(d / "predictors"),
                     "--prompt-ids", "1,2,3,4", "--max-new-tokens", "8", "--ignore-eos", "--json", *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0]["decode_path"] == "fused" and runs[1]["decode_path"] == "modules"
    # int8 scores/activations vs the module path's float ones: near-ties of a random model may flip late tokens
    assert runs[0]["token_ids"][:4] == runs[1]["token_ids"][:4]
    from placement.fused_calibration import FusedCalibration, FusedTerms, KindRate, save_calibration
    terms = (FusedTerms("int4", 20e-6, 2e-6, 0.8), FusedTerms("int8", 20e-6, 2e-6, 0.8))
    cal = FusedCalibration(2, 30e9, terms)
    save_calibration(cal, d / "cal.json")
    assert main(["show-plan", str(d / "plan"), "--calibration", str(d / "cal.json"), "--measure", m,
                 "--predictors", str(d / "predictors"), "--threads", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "modeled (calibrated" in line and "measured" in line and "fused decode path" in line
    # per-format rates: the reads of the step the runtime built, by format and access
    kinds = ("q4_0", "q4_1", "q8_0", "q6_k", "q4_k", "q5_0", "q5_k", "f32", "f16", "int8", "int8b", "int4")
    rates = tuple(KindRate(k, a, 0.5) for k in kinds for a in ("dense", "gather", "axpy"))
    save_calibration(FusedCalibration(2, 30e9, terms, rates=rates), d / "cal.json")
    assert main(["show-plan", str(d / "plan"), "--calibration", str(d / "cal.json"), "--measure", m,
                 "--predictors", str(d / "predictors"), "--threads", "2"]) == 0
    side, reads = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "modeled (by packed format)" in side and "n/a" not in side and reads.startswith("modeled reads per token: ")


def test_gate_values_that_would_degenerate_the_model_are_refused():
    """--gate-noise nan / inf made a 100%-sparse model and bare NaN in the sidecar JSON; --gate-rank past what the
    shape holds was cut to it in silence. All three are refused naming the flag (reference: the valid edges load)."""
    tiny = get_shape("tiny")
    for kwargs, fragment in (({"gate_noise": float("nan")}, "--gate-noise"),
                             ({"gate_noise": float("inf")}, "--gate-noise"),
                             ({"gate_rank": (tiny.hidden - 32) // 2 + 1}, "--gate-rank must be at most 48")):
        with pytest.raises(TandemError, match=fragment):
            SynthSpec(tiny, **kwargs)
    SynthSpec(tiny, gate_rank=(tiny.hidden - 32) // 2, gate_noise=0.0)


def test_a_packed_engine_reads_a_q4_output_layer_as_stored(tiny90):
    """The output layer kept its GGUF blocks only when they were Q8_0: a synthetic model's Q4_0 head (or a Q6_K one
    from a downloaded Q4_K_M) was decoded and quantized again, up to 1.17 off in a logit (std 2.6) on the module
    path. Reference: the float32 engine, which decodes the same blocks exactly."""
    ids = [5806, 16033, 16762, 34565, 7955, 43234, 35220, 27248, 13513, 6555]
    ref = Engine.load(str(tiny90.path), weight_format="fp32").step_logits(ids)
    packed = Engine.load(str(tiny90.path), weight_format="int4", fused_decode=False, down_format="fp32")
    assert packed.executor.head.fmt == Engine.load(str(tiny90.path), weight_format="int8",
                                                   fused_decode=False).executor.head.fmt  # one kind for both
    assert (packed.step_logits(ids) - ref).abs().max() < 1e-3
