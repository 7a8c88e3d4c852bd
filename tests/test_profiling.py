"""Offline profiler against independent references: transformers' own activations and router outputs,
brute-force counts, exact quantiles, analytic search targets, and the artifact loader's checks."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers_tiny import build_tiny_chat_model
from offline.calibration import (CalibrationSet, build_calibration_set, builtin_documents, parse_corpus,
                                 read_text_files, split_documents)
from offline.collect import (InstrumentedExecutor, LayerObservation, collect_layer_activations,
                             iter_calibration_batches, run_windows, split_windows)
from offline.moe_stats import ExpertObserver
from offline.neurons import hot_order, skew_fraction
from offline.profile_artifact import load_profile, save_profile
from offline.profiler import SEARCH_BUDGET_SHARE, profile_model
from offline.thresholds import AbsHistogram, ThresholdedExecutor, search_uniform_sparsity
from online import Engine
from tandem.core.generate import prefill
from tandem.core.kv_cache import KVCache
from tandem.cli import main as tandem_main
from tandem.core.errors import ArtifactError, TandemError

WINDOW = 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_docs(n_docs: int, doc_tokens: int, vocab: int = 128, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (doc_tokens,), generator=g).tolist() for _ in range(n_docs)]


def train_windows(docs: list[list[int]]) -> list[list[int]]:
    """The windows profile_model runs the training split in (every 5th document held out)."""
    train, _ = split_documents(docs)
    flat = [t for d in train for t in d]
    return [flat[i:i + WINDOW] for i in range(0, len(flat), WINDOW)]


def hf_capture(hf_model, windows, module_of_layer, pre: bool):
    """Per layer, the concatenated input (pre=True) or output of a transformers submodule over windows."""
    captured: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, module in enumerate(module_of_layer(hf_model)):
        def hook(mod, args, out=None, i=i):
            t = args[0] if pre else out
            captured.setdefault(i, []).append(t.detach().reshape(-1, t.shape[-1]).clone())
        hooks.append(module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook))
    outputs = []
    kwargs = {"output_router_logits": True} if hasattr(hf_model.config, "num_local_experts") else {}
    try:
        with torch.no_grad():
            for w in windows:
                outputs.append(hf_model(torch.tensor([w]), **kwargs))
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat(v) for i, v in captured.items()}, outputs


@pytest.fixture(scope="module")
def tiny_mixtral3(tmp_path_factory):
    """A 3-layer tiny Mixtral, so speculative recall 2 layers ahead exists."""
    import transformers as tf
    torch.manual_seed(3)
    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, intermediate_size=48,
                           max_position_embeddings=128)
    model = tf.MixtralForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-mixtral3")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def tiny_chat_folder(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


# --- instrumentation -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2_moe"])
def test_instrumented_executor_is_exactly_dense(tiny_model_dir, kind):
    folder, hf_model = tiny_model_dir(kind)
    engine = Engine.load(str(folder))
    ids = random_docs(1, 40, seed=1)[0]
    seen = []

    class Count:
        def observe(self, obs: LayerObservation) -> None:
            seen.append(obs.layer)
    dense = prefill(engine.model, engine.executor, KVCache(engine.config, 64), ids, all_logits=True)
    ours = prefill(engine.model, InstrumentedExecutor(engine.executor, Count()), KVCache(engine.config, 64), ids,
                   all_logits=True)
    assert torch.equal(ours, dense)
    assert seen == list(range(engine.config.num_layers))
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_collect_layer_activations_match_transformers_hooks(tiny_model_dir):
    folder, hf_model = tiny_model_dir("llama")
    engine = Engine.load(str(folder))
    docs = random_docs(3, 30, seed=2)
    acts = collect_layer_activations(engine, docs, layers=[1], window_tokens=WINDOW)
    assert list(acts) == [1]
    windows = split_windows(docs, WINDOW)
    ref_x, _ = hf_capture(hf_model, windows, lambda m: [l.mlp for l in m.model.layers], pre=True)
    ref_h, _ = hf_capture(hf_model, windows, lambda m: [l.mlp.down_proj for l in m.model.layers], pre=True)
    x, h = acts[1]
    assert x.shape == (90, 64) and h.shape == (90, 128)
    torch.testing.assert_close(x, ref_x[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h, ref_h[1], rtol=1e-4, atol=1e-5)
    # ordinary tensors: a predictor can train on them
    w = torch.zeros(64, 128, requires_grad=True)
    ((x @ w - h) ** 2).mean().backward()
    assert w.grad is not None
    batches = list(iter_calibration_batches(engine, docs, window_tokens=WINDOW))
    assert [len(b.token_ids) for b in batches] == [32, 32, 26]
    assert sorted(batches[0].layers) == [0, 1]
    torch.testing.assert_close(batches[2].layers[0].h, ref_h[0][64:], rtol=1e-4, atol=1e-5)
    with pytest.raises(TandemError):
        collect_layer_activations(engine, docs, layers=[5])


# --- neurons (ReLU) ------------------------------------------------------------------------------
def test_relu_frequencies_equal_brute_force_count_opt(tiny_model_dir):
    folder, hf_model = tiny_model_dir("opt")
    engine = Engine.load(str(folder))
    docs = random_docs(10, 45, seed=4)
    profile = profile_model(engine, docs, window_tokens=WINDOW, progress=False)
    assert profile.activity == "relu"
    windows = train_windows(docs)
    ref_h, _ = hf_capture(hf_model, windows, lambda m: [l.fc2 for l in m.model.decoder.layers], pre=True)
    ref_z, _ = hf_capture(hf_model, windows, lambda m: [l.fc1 for l in m.model.decoder.layers], pre=False)
    n_tokens = sum(map(len, windows))
    for i in range(2):
        assert ref_h[i].shape == (n_tokens, 128)
        counts = profile.neuron_freq[i].double() * n_tokens
        assert torch.allclose(counts, counts.round(), atol=1e-3)
        strict = (ref_z[i] > 1e-5).sum(0).double()  # surely active in transformers
        loose = (ref_z[i] > -1e-5).sum(0).double()  # active up to float noise
        assert torch.all(counts.round() >= strict) and torch.all(counts.round() <= loose)
        assert int((loose - strict).sum()) <= 2  # the count is pinned down almost everywhere
        torch.testing.assert_close(profile.tensors["neuron_mean_abs"][i], ref_h[i].abs().mean(0), rtol=1e-4, atol=1e-6)
        freq = profile.neuron_freq[i]
        order = profile.tensors["hot_order"][i]
        assert sorted(order.tolist()) == list(range(128))
        assert torch.all(freq[order][:-1] >= freq[order][1:])
        assert math.isclose(float(profile.tensors["layer_sparsity"][i]), 1 - float((ref_h[i] > 0).double().mean()), abs_tol=2e-4)
        # skew by brute force: smallest number of neurons whose counts reach 80% of all activations
        c = sorted((ref_h[i] > 0).sum(0).tolist(), reverse=True)
        k = next(k for k in range(1, 129) if sum(c[:k]) >= 0.8 * sum(c))
        assert math.isclose(float(profile.tensors["neuron_skew"][i]), k / 128, abs_tol=1.5 / 128)
    assert profile.quality["perplexity_increase"] == 0.0 and not profile.quality["search"]
    assert profile.quality["uniform_sparsity"] is None and not profile.thresholds.any()


def test_hot_order_and_skew_on_known_values():
    freq = torch.tensor([[0.1, 0.5, 0.5, 0.0, 0.9]])
    mean_abs = torch.tensor([[1.0, 0.2, 0.7, 0.0, 3.0]])
    assert hot_order(freq, mean_abs).tolist() == [[4, 2, 1, 0, 3]]
    # total 2.0; 80% = 1.6 -> 0.9 + 0.5 + 0.5 = 1.9 needs 3 of 5 neurons
    assert skew_fraction(freq).tolist() == pytest.approx([0.6])
    assert skew_fraction(torch.full((1, 10), 0.3)).tolist() == pytest.approx([0.8])
    assert math.isnan(float(skew_fraction(torch.zeros(1, 4))[0]))


# --- thresholds ----------------------------------------------------------------------------------
def test_thresholds_hit_requested_sparsity_on_known_inputs():
    g = torch.Generator().manual_seed(5)
    values = {0: torch.exp(torch.randn(4000, 96, generator=g) * 2.0 - 3.0) * torch.sign(torch.randn(4000, 96, generator=g)),
              1: torch.rand(4000, 96, generator=g) * 10.0}
    values[0][:80] = 0.0  # exact zeros (2%) count as the smallest values
    hist = AbsHistogram(2)
    for i, v in values.items():
        for chunk in v.split(1000):
            hist.observe(LayerObservation(layer=i, x=torch.zeros(chunk.shape[0], 4), h=chunk))
    for q in (0.05, 0.2, 0.45, 0.5, 0.7, 0.9):
        t = hist.quantile_thresholds(q)
        for i, v in values.items():
            achieved = float((v.abs() <= t[i]).double().mean())
            assert abs(achieved - q) < 2e-3, (q, i, achieved)
            flat = v.abs().flatten()
            exact = flat.kthvalue(max(1, round(q * flat.numel()))).values
            if exact > 0:
                assert math.isclose(float(t[i]), float(exact), rel_tol=0.02)
    assert hist.quantile_thresholds(0.0).tolist() == [0.0, 0.0]


def test_thresholded_executor_matches_transformers_with_zeroed_h(tiny_model_dir):
    folder, hf_model = tiny_model_dir("llama")
    engine = Engine.load(str(folder))
    ids = random_docs(1, 48, seed=6)[0]
    thresholds = torch.tensor([0.02, 0.05])
    executor = ThresholdedExecutor(engine.executor, thresholds)
    ours = prefill(engine.model, executor, KVCache(engine.config, 64), ids, all_logits=True)
    zeroed = {0: 0, 1: 0}
    hooks = []
    for i, layer in enumerate(hf_model.model.layers):
        def pre(mod, args, i=i):
            h = args[0]
            keep = h.abs() > thresholds[i]
            zeroed[i] += int((~keep).sum())
            return (h * keep,)
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    expected = torch.tensor([zeroed[0], zeroed[1]], dtype=torch.float64) / (48 * 128)
    assert torch.allclose(executor.sparsity().double(), expected, atol=2 / (48 * 128))
    assert 0.05 < float(expected.min()) < 0.95  # the thresholds really cut something
    # threshold 0 is the dense model exactly
    dense = ThresholdedExecutor(engine.executor, torch.zeros(2))
    assert torch.equal(prefill(engine.model, dense, KVCache(engine.config, 64), ids, all_logits=True),
                       prefill(engine.model, engine.executor, KVCache(engine.config, 64), ids, all_logits=True))


def test_bisection_finds_largest_sparsity_within_budget(tiny_model_dir, monkeypatch):
    """With a known increase(q) = 0.5 q^2 the answer is sqrt(2 * budget), to the bisection's resolution."""
    import offline.thresholds as th
    folder, _ = tiny_model_dir("llama")
    engine = Engine.load(str(folder))

    class UniformHist:
        def quantile_thresholds(self, q: float) -> torch.Tensor:
            return torch.full((2,), q)

    def fake_perplexity(engine, executor, windows, on_window=None):
        q = executor.thresholds[0] if isinstance(executor, ThresholdedExecutor) else 0.0
        return 10.0 * (1 + 0.5 * q * q), 100
    monkeypatch.setattr(th, "windows_perplexity", fake_perplexity)
    for budget in (0.01, 0.02, 0.05):
        result = search_uniform_sparsity(engine, UniformHist(), [[1, 2, 3]], budget, steps=10)
        target = math.sqrt(2 * budget)
        assert target - 0.95 / 2 ** 10 <= result.quantile <= target
        assert result.increase <= budget
        assert len(result.points) == 10


def test_threshold_profile_on_tiny_llama(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    engine = Engine.load(str(folder))
    docs = random_docs(10, 40, seed=7)
    profile = profile_model(engine, docs, window_tokens=WINDOW, max_quality_loss=0.05, search_steps=4, progress=False)
    q = profile.quality
    assert profile.activity == "threshold"
    assert q["perplexity_increase"] <= 0.05 and len(q["search"]) == 4
    # the reported held-out perplexities are what a fresh thresholded run measures
    from offline.thresholds import windows_perplexity
    _, held = split_documents(docs)
    ppl, _ = windows_perplexity(engine, ThresholdedExecutor(engine.executor, profile.thresholds), split_windows(held, WINDOW))
    assert math.isclose(ppl, q["sparse_perplexity"], rel_tol=1e-5)
    flat_held = [t for d in held for t in d]
    engine_ppl, _ = engine.perplexity(flat_held, window_tokens=WINDOW, stride_tokens=WINDOW)
    assert math.isclose(q["dense_perplexity"], engine_ppl, rel_tol=1e-5)
    # the frequencies count |h| > threshold on the training windows
    acts = collect_layer_activations(engine, train_windows(docs), window_tokens=WINDOW)
    for i, (_, h) in acts.items():
        ref = (h.abs() > profile.thresholds[i]).double().mean(0).float()
        torch.testing.assert_close(profile.neuron_freq[i], ref, atol=1e-6, rtol=0)
        assert math.isclose(float(profile.tensors["layer_sparsity"][i]), 1 - float(ref.double().mean()), abs_tol=1e-5)
        if q["uniform_sparsity"] > 0:
            assert abs(float(profile.tensors["layer_sparsity"][i]) - q["uniform_sparsity"]) < 0.01
    # the speculative drafter's looser thresholds: within their budget on the training windows, re-measured
    draft = profile.tensors["draft_thresholds"]
    assert bool((draft >= profile.thresholds).all()) and q["draft"]["uniform_sparsity"] >= q["uniform_sparsity"]
    windows = train_windows(docs)
    dense_train, _ = windows_perplexity(engine, engine.executor, windows)
    draft_train, _ = windows_perplexity(engine, ThresholdedExecutor(engine.executor, draft), windows)
    assert math.isclose(draft_train / dense_train - 1, q["draft"]["selection_perplexity_increase"], abs_tol=1e-5)
    assert q["draft"]["selection_perplexity_increase"] <= q["draft"]["max_quality_loss"]


# --- MoE -----------------------------------------------------------------------------------------
def test_moe_counts_equal_brute_force_from_transformers_router(tiny_mixtral3):
    folder, hf_model = tiny_mixtral3
    engine = Engine.load(str(folder))
    windows = split_windows(random_docs(4, 40, seed=8), WINDOW)
    stats = ExpertObserver(engine.config, engine.executor.layers)
    for _ in run_windows(engine, InstrumentedExecutor(engine.executor, stats), windows):
        pass
    ref_x, outputs = hf_capture(hf_model, windows, lambda m: [l.post_attention_layernorm for l in m.model.layers], pre=False)
    n_layers, n_experts, k = 3, 6, 2
    sets = {i: [] for i in range(n_layers)}  # per layer, per window: top-k ids [T, k]
    for out in outputs:
        for i, logits in enumerate(out.router_logits):
            sets[i].append(torch.softmax(logits.float(), -1).topk(k, -1).indices)
    for i in range(n_layers):
        freq = torch.zeros(n_experts)
        co = torch.zeros(n_experts, n_experts)
        repeats = pairs = kept = 0
        for ids in sets[i]:
            rows = [set(r.tolist()) for r in ids]
            for s in rows:
                for a in s:
                    freq[a] += 1
                    for b in s:
                        co[a, b] += 1
            for prev, cur in zip(rows, rows[1:]):
                pairs += 1
                repeats += prev == cur
                kept += len(prev & cur)
        n_tokens = sum(len(w) for w in windows)
        torch.testing.assert_close(stats.frequency()[i], freq / n_tokens)
        torch.testing.assert_close(stats.coselection()[i], co)
        assert math.isclose(float(stats.repeat_rate()[i]), repeats / pairs, abs_tol=1e-6)
        assert math.isclose(float(stats.kept_rate()[i]), kept / (pairs * k), abs_tol=1e-6)
        assert 0 < repeats < pairs  # the statistic is not degenerate here
    # speculative recall: layer l+a's router (transformers' gate weights) on layer l's FFN input
    recall = stats.speculative_recall()
    for src in range(n_layers):
        for slot, ahead in enumerate((1, 2)):
            dst = src + ahead
            if dst >= n_layers:
                assert math.isnan(float(recall[src, slot]))
                continue
            gate = hf_model.model.layers[dst].mlp.gate.weight
            guess = torch.softmax(ref_x[src] @ gate.T, -1).topk(k, -1).indices
            actual = torch.cat(sets[dst])
            hits = sum(len(set(g.tolist()) & set(a.tolist())) for g, a in zip(guess, actual))
            assert math.isclose(float(recall[src, slot]), hits / actual.numel(), abs_tol=1e-6)


def test_moe_profile_tensors(tiny_mixtral3):
    folder, _ = tiny_mixtral3
    engine = Engine.load(str(folder))
    profile = profile_model(engine, random_docs(10, 30, seed=9), window_tokens=WINDOW, search_steps=2, progress=False)
    t = profile.tensors
    assert profile.is_moe and t["expert_freq"].shape == (3, 6) and t["expert_coselect"].shape == (3, 6, 6)
    assert t["spec_recall"].shape == (3, 2) and t["expert_neuron_freq"].shape == (3, 6, 48)
    torch.testing.assert_close(t["expert_freq"].sum(1), torch.full((3,), 2.0))
    assert profile.layers[0]["kind"] == "moe" and profile.layers[0]["spec_recall_1"] is not None
    from offline.plot import render_profile_png
    assert render_profile_png(profile)[:8] == b"\x89PNG\r\n\x1a\n"  # with the expert heat map


# --- calibration ---------------------------------------------------------------------------------
def test_builtin_corpus_is_varied_and_split_deterministically():
    docs = builtin_documents()
    kinds = {d.kind for d in docs}
    assert len(docs) >= 30 and {"chat", "code", "story", "science", "history", "instructions", "dialogue"} <= kinds
    chats = [d for d in docs if d.is_chat]
    assert len(chats) >= 5 and all(r in ("system", "user", "assistant") for d in chats for r, _ in d.messages)
    assert sum(len(d.text.split()) for d in docs) + sum(len(c.split()) for d in chats for _, c in d.messages) > 6000
    ids = [[i] for i in range(12)]
    train, held = split_documents(ids)
    assert held == [[4], [9]] and len(train) == 10
    assert split_documents([[1, 2], [3]]) == ([[1, 2]], [[3]])
    with pytest.raises(TandemError):
        split_documents([[1, 2, 3]])


def test_corpus_parser_chat_turns():
    docs = parse_corpus("header\n=== chat | t\n@system: be brief\n@user: hi\nsecond line\n@assistant: hello\n=== code | c\nx = 1\n")
    assert docs[0].messages == (("system", "be brief"), ("user", "hi\nsecond line"), ("assistant", "hello"))
    assert docs[1].kind == "code" and docs[1].text == "x = 1"


def test_calibration_files_errors(tmp_path):
    with pytest.raises(TandemError, match="not found"):
        read_text_files([tmp_path / "missing.txt"])
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(TandemError, match="empty"):
        read_text_files([tmp_path / "empty.txt"])
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(TandemError, match="UTF-8"):
        read_text_files([tmp_path / "bin.txt"])


def test_calibration_set_renders_chat_with_template(tiny_chat_folder):
    engine = Engine.load(str(tiny_chat_folder))
    calib = build_calibration_set(engine, max_tokens=3000)
    assert calib.train_tokens + calib.held_out_tokens == 3000
    assert calib.held_out_tokens == pytest.approx(3000 * 0.19, rel=0.3)
    full = build_calibration_set(engine)
    im_start = engine.tokenizer.token_to_id("<|im_start|>")
    assert any(im_start in d for d in full.train + full.held_out)
    assert full.source["kind"] == "builtin" and full.source["chat_documents"] >= 5


# --- artifact ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_profile(tiny_model_dir, tmp_path_factory):
    folder, _ = tiny_model_dir("llama")
    engine = Engine.load(str(folder))
    profile = profile_model(engine, random_docs(10, 30, seed=10), window_tokens=WINDOW, search_steps=3, progress=False)
    out = tmp_path_factory.mktemp("prof") / "profile"
    save_profile(profile, out)
    return engine, profile, out


def test_artifact_round_trip(saved_profile):
    engine, profile, out = saved_profile
    loaded = load_profile(out, expected_model_fingerprint=engine.model_fingerprint)
    assert set(loaded.tensors) == set(profile.tensors)
    for key, value in profile.tensors.items():
        assert torch.equal(loaded.tensors[key], value), key
    assert loaded.to_meta() == json.loads(json.dumps(profile.to_meta()))
    assert loaded.fingerprint == profile.fingerprint and loaded.activity == "threshold"


def test_profile_for_another_model_is_refused(saved_profile, tiny_model_dir):
    _, _, out = saved_profile
    other = Engine.load(str(tiny_model_dir("qwen2")[0]))
    with pytest.raises(ArtifactError, match="another model"):
        load_profile(out, expected_model_fingerprint=other.model_fingerprint)


def test_corrupted_artifact_gives_clear_error(saved_profile, tmp_path, capsys):
    import shutil
    _, _, out = saved_profile
    truncated = tmp_path / "truncated"
    shutil.copytree(out, truncated)
    blob = (truncated / "profile.safetensors").read_bytes()
    (truncated / "profile.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ArtifactError, match="corrupted"):
        load_profile(truncated)
    edited = tmp_path / "edited"
    shutil.copytree(out, edited)
    meta = json.loads((edited / "profile.json").read_text())
    meta["quality"]["perplexity_increase"] = 0.0001
    (edited / "profile.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="corrupted"):
        load_profile(edited)
    (edited / "profile.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="corrupted"):
        load_profile(edited)
    assert tandem_main(["show-profile", str(truncated)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: corrupted profile tensors") and "\n" not in err


def test_interrupted_save_leaves_no_artifact(saved_profile, tmp_path, monkeypatch):
    import tandem.core.artifacts as artifacts
    _, profile, _ = saved_profile

    def explode(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(artifacts, "save_file", explode)
    with pytest.raises(KeyboardInterrupt):
        save_profile(profile, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# --- CLI -----------------------------------------------------------------------------------------
def test_cli_profile_end_to_end(tiny_chat_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = tandem_main(["profile", "--model", str(tiny_chat_folder), "--tokens", "800", "--window", "64",
                      "--search-steps", "3", "--plot", "--no-progress", "--threads", "1"])
    assert rc == 0
    out_dir = tmp_path / "profiles" / tiny_chat_folder.name / "profile"
    assert (out_dir / "profile.json").is_file() and (out_dir / "profile.safetensors").is_file()
    assert (out_dir / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    engine = Engine.load(str(tiny_chat_folder))
    profile = load_profile(out_dir, expected_model_fingerprint=engine.model_fingerprint)
    assert profile.calibration["kind"] == "builtin"
    assert profile.calibration["train_tokens"] + profile.calibration["held_out_tokens"] == 800
    assert profile.quality["max_quality_loss"] == 0.02 and profile.quality["perplexity_increase"] <= 0.02
    printed = capsys.readouterr().out
    assert "quality: held-out perplexity" in printed and "picture:" in printed
    assert tandem_main(["show-profile", str(out_dir)]) == 0
    assert "layer" in capsys.readouterr().out
    user_file = tmp_path / "mine.txt"
    user_file.write_text("A user's own text about rivers, bridges and boats. " * 60)
    rc = tandem_main(["profile", "--model", str(tiny_chat_folder), "--calib", str(user_file), "--out", "custom",
                      "--window", "64", "--search-steps", "2", "--no-progress", "--max-quality-loss", "0.05"])
    assert rc == 0
    assert load_profile(tmp_path / "custom").calibration["files"][0]["path"] == str(user_file)


@pytest.mark.parametrize("argv, message", [
    (["--calib", "nope.txt"], "calibration file not found"),
    (["--max-quality-loss", "0"], "--max-quality-loss"),
    (["--tokens", "3"], "--tokens"),
])
def test_cli_profile_user_errors(tiny_chat_folder, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert tandem_main(["profile", "--model", str(tiny_chat_folder), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "profiles").exists()


def test_cli_profile_empty_calib_file(tiny_chat_folder, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert tandem_main(["profile", "--model", str(tiny_chat_folder), "--calib", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


# --- the real model --------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_profile_cli(smollm2_path, tmp_path):
    from offline.calibration import render_document
    from tandem.core.loading.gguf_loader import read_gguf
    from tandem.core.loading.tokenizer import Tokenizer
    _, fields = read_gguf(smollm2_path)
    tok = Tokenizer.from_gguf_metadata(fields)
    assert sum(len(render_document(d, tok)) for d in builtin_documents()) >= 6000
    out = tmp_path / "smol"
    rc = tandem_main(["profile", "--model", "smollm2", "--tokens", "1200", "--search-steps", "3", "--plot",
                      "--out", str(out), "--no-progress", "--threads", "2"])
    assert rc == 0
    profile = load_profile(out)
    assert profile.activity == "threshold" and profile.neuron_freq.shape == (30, 1536)
    q = profile.quality
    assert q["search_target"] == pytest.approx(0.02 * SEARCH_BUDGET_SHARE)  # a reserve for noise and kernels
    assert q["selection_perplexity_increase"] <= q["search_target"]  # searched on the training windows
    assert q["sparse_perplexity"] == pytest.approx(q["dense_perplexity"] * (1 + q["perplexity_increase"]), rel=1e-5)
    t = profile.thresholds
    assert float(t[-1]) > float(t[0]) > 0  # thresholds rise with depth (measurements.md)
    assert (out / "profile.png").is_file()


def test_self_generated_text_joins_the_training_split_only(tiny_chat_folder):
    engine = Engine.load(str(tiny_chat_folder))
    plain = build_calibration_set(engine, max_tokens=600)
    calib = build_calibration_set(engine, max_tokens=600, self_generated_tokens=50)
    generated = calib.source["self_generated_tokens"]
    assert generated > 0
    assert calib.held_out == plain.held_out and calib.train[:len(plain.train)] == plain.train
    user_turn = engine.tokenizer.encode_chat([{"role": "user", "content": calib_seed_prompt()}])
    assert calib.train[len(plain.train)][:len(user_turn)] == user_turn
    assert calib.train_tokens == plain.train_tokens + generated


def calib_seed_prompt() -> str:
    from offline.calibration import seed_prompts
    return seed_prompts()[0]
