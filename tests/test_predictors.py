"""Activation predictors: training, gated execution, the artifact and the CLI (tiny random models)."""
from __future__ import annotations

import json

import pytest
import torch

from offline.calibration import CalibrationSet
from offline.profile_artifact import Profile
from online import Engine
from tandem.core.ffn import DenseExecutor
from tandem.core.ffn.dense import ffn_hidden
from tandem.core.generate import prefill
from tandem.core.kv_cache import KVCache
from predictors.artifact import load_predictors, save_predictors
from predictors.gated import PredictorGatedExecutor
from predictors.model import LayerEntry, LayerPredictor, PredictorSet
from predictors.pipeline import build_predictors
from predictors.train import TrainSettings, fit_layer, layer_labels, operating_point, predict_scores
from tandem.core.errors import ArtifactError

@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and a busy machine makes two of them much slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FAST = TrainSettings(ranks=(16, 32, 64), max_epochs=15, patience=2, learning_rate=1e-2, batch_tokens=128)


def random_ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def all_on_predictor(d: int, n_ff: int) -> LayerPredictor:
    """Scores +10 for every neuron whatever the input (threshold 0 marks all active)."""
    pred = LayerPredictor(d, 16, n_ff)
    with torch.no_grad():
        for p in pred.parameters():
            p.zero_()
        pred.up.bias.fill_(10.0)
    return pred.eval().requires_grad_(False)


def hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def make_profile(engine, activity: str, thresholds: torch.Tensor | None = None) -> Profile:
    n, f = engine.config.num_layers, engine.config.intermediate_size
    t = torch.zeros(n) if thresholds is None else thresholds
    tensors = {"neuron_freq": torch.full((n, f), 0.5), "neuron_mean_abs": torch.ones(n, f),
               "hot_order": torch.arange(f).repeat(n, 1), "thresholds": t, "layer_sparsity": torch.full((n,), 0.5)}
    return Profile(engine.model_fingerprint, engine.model_id, activity, tensors,
                   calibration={"kind": "token_ids"}, quality={"max_quality_loss": 0.02})


# --- training -----------------------------------------------------------------------------------
def test_training_learns_a_linear_pattern_to_high_recall():
    """Labels that are a fixed linear rule of x (what a ReLU FFN's h > 0 is) are learned."""
    g = torch.Generator().manual_seed(0)
    d, n_ff = 32, 96
    w = torch.randn(n_ff, d, generator=g)
    b = torch.randn(n_ff, generator=g) - 1.5  # ~40% active
    x = torch.randn(4000, d, generator=g)
    y = (x @ w.T + b) > 0
    tr, va, te = slice(0, 2500), slice(2500, 3200), slice(3200, 4000)
    fit = fit_layer(x[tr], y[tr], x[va], y[va], gate_up_flops=10**9, settings=FAST)  # work: rank hardly matters
    mask = predict_scores(fit.predictor, x[te]) >= fit.point.threshold
    recall = float((mask & y[te]).sum() / y[te].sum())  # brute-force count on unseen tokens
    precision = float((mask & y[te]).sum() / mask.sum())
    assert recall >= 0.92 and precision >= 0.85
    assert fit.rank >= 32  # rank 16 < d cannot express the rule; the ladder climbs past it
    assert fit.point.recall >= 0.95  # chosen on the validation tokens for the target


def _low_rank_gate(seed: int, d: int = 48, n_ff: int = 160, rank: int = 6, n: int = 3000):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_ff, rank, generator=g) @ torch.randn(rank, d, generator=g) / rank ** 0.5  # [F, d] rank 6
    mix = torch.randn(d, d, generator=g) / d ** 0.5 + torch.eye(d)  # correlated inputs
    x = torch.randn(n, d, generator=g) @ mix  # [N, d]
    b = torch.randn(n_ff, generator=g) - 1.0
    return w, b, x


def test_linear_predictor_scores_are_the_preactivation():
    """With at least the gate's rank, the closed-form scorer's score is W x + b itself (brute-force matmul);
    with fewer directions it is the least-squares rank-r fit over the inputs (checked against a
    direct least-squares solve of W x on x's top directions)."""
    from predictors.gate_rrr import linear_predictor, preactivation_basis
    w, b, x = _low_rank_gate(3)
    basis = preactivation_basis(x[:2000], w)
    full = linear_predictor(basis, 6, b)
    assert full.rank == 12
    torch.testing.assert_close(predict_scores(full, x[2000:]), x[2000:] @ w.T + b, atol=2e-4, rtol=1e-4)
    r = 3
    approx = predict_scores(linear_predictor(basis, r), x[:2000])  # [N, F]
    err = float(((approx - x[:2000] @ w.T) ** 2).mean())
    # the optimum over every rank-3 map: regress W x on the span of x's projections onto its best r directions
    target = x[:2000].double() @ w.T.double()
    u, sv, vh = torch.linalg.svd(target, full_matrices=False)
    best = float((((u[:, r:] * sv[r:]) @ vh[r:]) ** 2).mean())  # Eckart-Young bound of the fitted values
    assert err <= best * 1.01 + 1e-9


def test_fit_layer_takes_the_closed_form_scorer_on_a_low_rank_gate():
    """Labels g > 0 of a rank-6 gate: the reduced-rank copy is (near) exact and beats trained scorers."""
    w, b, x = _low_rank_gate(4)
    y = (x @ w.T + b) > 0
    tr, va, te = slice(0, 2000), slice(2000, 2500), slice(2500, 3000)
    fit = fit_layer(x[tr], y[tr], x[va], y[va], gate_up_flops=10**9, settings=FAST, preactivation=(w, b))
    chosen = [t for t in fit.tried if t["rank"] == fit.rank and t["precision"] == fit.point.precision]
    assert chosen and chosen[0]["kind"] == "linear"
    mask = predict_scores(fit.predictor, x[te]) >= fit.point.threshold
    assert float((mask & y[te]).sum() / mask.sum()) >= 0.9  # precision on unseen tokens
    assert float((mask & y[te]).sum() / y[te].sum()) >= 0.9


@pytest.mark.parametrize("target", [0.5, 0.9, 0.95, 0.99])
def test_operating_point_matches_scikit_learn(target):
    from sklearn.metrics import precision_recall_curve
    g = torch.Generator().manual_seed(1)
    scores, labels = torch.randn(300, 40, generator=g), torch.rand(300, 40, generator=g) < 0.3
    scores = scores + labels * 0.8  # informative scores
    point = operating_point(scores, labels, target)
    precision, recall, thresholds = precision_recall_curve(labels.flatten().numpy(), scores.flatten().double().numpy())
    i = max(j for j in range(len(thresholds)) if recall[j] >= target)  # highest threshold reaching the target
    assert point.threshold == pytest.approx(float(thresholds[i]))
    assert point.recall == pytest.approx(float(recall[i])) and point.recall >= target
    assert point.precision == pytest.approx(float(precision[i]))
    assert point.active_fraction == pytest.approx(float((scores >= point.threshold).float().mean()))


def test_labels_match_transformers_activations(tiny_model_dir):
    """Our labels (h > 0 from the collected FFN input) equal transformers' own fc1 ReLU outputs > 0."""
    from offline.collect import collect_layer_activations
    folder, hf_model = tiny_model_dir("opt")
    engine = Engine.load(str(folder))
    ids = random_ids(60, 3)
    x, _ = collect_layer_activations(engine, ids, layers=[1])[1]
    seen = {}
    hook = hf_model.model.decoder.layers[1].fc1.register_forward_hook(lambda m, i, o: seen.update(fc1=o))
    try:
        hf_logits(hf_model, ids)
    finally:
        hook.remove()
    ours = layer_labels(engine.config, engine.executor.layers[1], x, 0.0)
    assert torch.equal(ours, seen["fc1"].reshape(ours.shape) > 0)


# --- gated execution ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "llama-relu", "opt"])
def test_all_on_predictor_equals_dense_and_transformers(tiny_model_dir, kind):
    folder, hf_model = tiny_model_dir(kind)
    engine = Engine.load(str(folder))
    cfg = engine.config
    pset = PredictorSet([LayerEntry("predictor", all_on_predictor(cfg.hidden_size, cfg.intermediate_size))
                         for _ in range(cfg.num_layers)])
    gated = PredictorGatedExecutor(cfg, engine.executor.layers, pset)
    ids = random_ids(40, 4)
    ours = prefill(engine.model, gated, KVCache(cfg, 64), ids, all_logits=True)
    dense = prefill(engine.model, DenseExecutor(cfg, engine.executor.layers), KVCache(cfg, 64), ids, all_logits=True)
    torch.testing.assert_close(ours, dense, rtol=0, atol=0)
    torch.testing.assert_close(ours, hf_logits(hf_model, ids), rtol=1e-4, atol=1e-5)
    assert gated.stats()["gate_up_fraction"] == 1.0


def test_gated_layer_equals_masked_reference_and_dense_marked_layer_is_dense(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    engine = Engine.load(str(folder))
    cfg, layers = engine.config, engine.executor.layers
    torch.manual_seed(5)
    pred = LayerPredictor(cfg.hidden_size, 16, cfg.intermediate_size).eval().requires_grad_(False)
    pset = PredictorSet([LayerEntry("predictor", pred, threshold=0.1), LayerEntry()])
    ex = PredictorGatedExecutor(cfg, layers, pset)
    x = torch.randn(7, cfg.hidden_size)
    mask = pred(x) >= 0.1
    assert 0 < float(mask.float().mean()) < 1
    w = layers[0]
    reference = (ffn_hidden(cfg, w, x) * mask) @ w.down.T  # naive: dense h, zero the skipped neurons
    torch.testing.assert_close(ex.forward(0, x), reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(ex.forward(1, x), DenseExecutor(cfg, layers).forward(1, x))
    assert torch.equal(pset.active_indices(0, x), mask.any(0).nonzero().flatten())
    assert pset.active_mask(1, x) is None and pset.mode(1) == "exact"
    t = torch.tensor([0.0, 0.05])
    exact = PredictorGatedExecutor(cfg, layers, None, exact_thresholds=t)
    h = ffn_hidden(cfg, layers[1], x)
    torch.testing.assert_close(exact.forward(1, x), (h * (h.abs() > 0.05)) @ layers[1].down.T, rtol=1e-5, atol=1e-6)
    # mode "gate": gate in full, up only where |silu(gate)| * scale passes, then the exact threshold
    scale = torch.rand(cfg.intermediate_size) + 0.5
    gate_set = PredictorSet([LayerEntry(), LayerEntry("gate", up_scale=scale, threshold=0.02)])
    ex = PredictorGatedExecutor(cfg, layers, gate_set, exact_thresholds=t)
    w = layers[1]
    a = torch.nn.functional.silu(x @ w.gate.T)
    keep = a.abs() * scale >= 0.02
    assert 0 < float(keep.float().mean()) < 1
    h = a * (x @ w.up.T) * keep
    torch.testing.assert_close(ex.forward(1, x), (h * (h.abs() > 0.05)) @ w.down.T, rtol=1e-5, atol=1e-6)
    assert ex.stats()["layers"][1]["up_fraction"] == pytest.approx(float(keep.float().mean()))


# --- artifact -----------------------------------------------------------------------------------
def small_set(meta_extra=None) -> PredictorSet:
    torch.manual_seed(6)
    stats = {"recall": 0.96, "precision": 0.5, "predicted_sparsity": 0.3}
    entries = [LayerEntry("predictor", LayerPredictor(8, 4, 12), threshold=-0.25, stats=stats),
               LayerEntry("gate", up_scale=torch.rand(12), threshold=0.5, stats=stats),
               LayerEntry(stats={"recall": 0.95, "precision": 0.4, "predicted_sparsity": 0.1, "reason": "x"}),
               LayerEntry(stats={"kind": "moe"})]
    meta = {"model_fingerprint": "m1", "profile_fingerprint": "p1", "model_id": "tiny", "model_param_count": 10_000}
    return PredictorSet(entries, meta={**meta, **(meta_extra or {})})


def test_artifact_round_trip_and_refusals(tmp_path):
    pset = small_set()
    out = tmp_path / "pred"
    save_predictors(pset, out)
    back = load_predictors(out, "m1", "p1")
    assert back.num_layers == 4 and [e.mode for e in back.entries] == ["predictor", "gate", "exact", "exact"]
    assert [e.use for e in back.entries] == [True, True, False, False]
    x = torch.randn(5, 8)
    assert torch.equal(back.active_mask(0, x), pset.active_mask(0, x))
    assert back.threshold(0) == -0.25 and back.entries[0].predictor.rank == 4
    a = torch.randn(5, 12)
    assert torch.equal(back.up_mask(1, a), a.abs() * pset.entries[1].up_scale >= 0.5)
    assert back.active_mask(1, x) is None and back.up_mask(0, a) is None
    meta = json.loads((out / "predictors.json").read_text())
    assert meta["layers"][1]["param_count"] == 12 and meta["layers"][2]["param_count"] == 0
    assert meta["layers"][0]["param_count"] == 8 * 4 + 4 + 4 * 12 + 12
    assert meta["share_of_model"] == pytest.approx((8 * 4 + 4 + 4 * 12 + 12 + 12) / 10_000)
    with pytest.raises(ArtifactError, match="another model"):
        load_predictors(out, "other")
    with pytest.raises(ArtifactError, match="another profile"):
        load_predictors(out, "m1", "other")
    meta["layers"][0]["threshold"] = 3.0
    (out / "predictors.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="corrupted"):
        load_predictors(out, "m1")
    (out / "predictors.safetensors").write_bytes(b"garbage")
    with pytest.raises(ArtifactError):
        load_predictors(out, "m1")
    with pytest.raises(ArtifactError, match="not found"):
        load_predictors(tmp_path / "missing", "m1")


# --- the whole pipeline -------------------------------------------------------------------------
def sparse_opt_folder(tmp_path):
    """A tiny OPT with a learnable, sparse ReLU FFN: fc1 of rank 8 and biases making ~10% of the
    neurons fire (trained OPT layers are sparse and far from random)."""
    import transformers as tf
    from conftest import TINY_COMMON
    torch.manual_seed(0)
    model = tf.OPTForCausalLM(tf.OPTConfig(ffn_dim=512, word_embed_proj_dim=64, **TINY_COMMON)).eval()
    with torch.no_grad():
        for layer in model.model.decoder.layers:
            a, b = torch.randn(512, 8), torch.randn(8, 64)
            layer.fc1.weight.copy_(a @ b * (0.02 / (a @ b).std()))  # pre-activation std ~0.16
            layer.fc1.bias.fill_(-0.2)
    model.save_pretrained(tmp_path / "sparse-opt")
    return tmp_path / "sparse-opt", model


def test_pipeline_on_sparse_relu_model_gates_within_budget(tmp_path):
    folder, hf_model = sparse_opt_folder(tmp_path)
    engine = Engine.load(str(folder))
    profile = make_profile(engine, "relu")
    docs = [random_ids(200, 10 + i) for i in range(12)]
    calib = CalibrationSet(train=docs[:10], held_out=docs[10:])
    settings = TrainSettings(ranks=(16, 32), max_epochs=6, learning_rate=1e-2, batch_tokens=128)
    pset = build_predictors(engine, profile, calib, settings, progress=False)
    q = pset.meta["quality"]
    assert q["exact_path_increase"] == pytest.approx(0.0, abs=1e-9)  # ReLU: the exact path is dense
    assert [e.mode for e in pset.entries] == ["predictor", "predictor"], pset.meta
    for e in pset.entries:
        assert e.stats["recall"] >= 0.95 and e.stats["predicted_sparsity"] > 0.5
    # independent re-check of what was reported: our own scoring of the used set, and transformers' dense logits
    from predictors.evaluate import HeldOutScorer
    scorer = HeldOutScorer(engine, calib.held_out, pset.meta["calibration"]["window_tokens"])
    ref = torch.cat([hf_logits(hf_model, w)[:-1] for w in scorer.windows])
    targets = torch.tensor(sum((w[1:] for w in scorer.windows), []))
    dense_ppl = float(torch.exp(torch.nn.functional.cross_entropy(ref.double(), targets)))
    assert scorer.dense.perplexity == pytest.approx(dense_ppl, rel=1e-4)
    again = scorer.score(PredictorGatedExecutor(engine.config, engine.executor.layers, pset))
    assert again.perplexity == pytest.approx(q["gated"]["perplexity"], rel=1e-9)
    assert again.increase_over(scorer.dense) <= q["limit"] + 1e-12
    assert again.gate_up_fraction < 0.5
    save_predictors(pset, tmp_path / "p")
    assert load_predictors(tmp_path / "p", engine.model_fingerprint, profile.fingerprint).num_layers == 2


def test_cli_end_to_end_on_tiny_chat_model(tmp_path):
    from helpers_tiny import build_tiny_chat_model
    from tandem.cli import main
    folder = build_tiny_chat_model(tmp_path / "model")
    prof, pred = tmp_path / "profile", tmp_path / "pred"
    assert main(["profile", "--model", str(folder), "--tokens", "1500", "--search-steps", "2",
                 "--out", str(prof), "--no-progress"]) == 0
    assert main(["train-predictors", "--model", str(folder), "--profile", str(prof), "--tokens", "1500",
                 "--max-rank", "32", "--out", str(pred), "--no-progress"]) == 0
    meta = json.loads((pred / "predictors.json").read_text())
    assert meta["kind"] == "predictors" and len(meta["layers"]) == 2
    for row in meta["layers"]:
        assert row["trained_rank"] in (16, 32) and row["recall"] >= 0.95 and row["mode"] in ("exact", "predictor", "gate")
    assert main(["train-predictors", "--model", str(folder), "--profile", str(tmp_path / "nope")]) == 2
    assert main(["train-predictors", "--model", str(folder), "--profile", str(prof), "--target-recall", "1.5"]) == 2


# --- MoE: next-layer expert guesses -------------------------------------------------------------
def test_expert_guess_recall_matches_transformers_routing(tiny_model_dir, tmp_path):
    from offline.collect import collect_layer_activations
    from predictors.expert import fit_expert_predictors, guess_next_experts
    folder, hf_model = tiny_model_dir("mixtral")
    engine = Engine.load(str(folder))
    cfg = engine.config
    ids = random_ids(120, 7)
    acts = collect_layer_activations(engine, ids)
    xs = {i: x for i, (x, _) in acts.items()}
    x_tr, x_va = {i: x[:80] for i, x in xs.items()}, {i: x[80:] for i, x in xs.items()}
    # brute force from transformers: layer 0's FFN input through layer 1's router vs layer 1's own top-2
    seen = {}
    hook = hf_model.model.layers[0].post_attention_layernorm.register_forward_hook(
        lambda m, i, o: seen.update(x0=o[0]))  # returns None: the output is left alone
    try:
        with torch.no_grad():
            router_logits = hf_model(torch.tensor([ids]), output_router_logits=True).router_logits
    finally:
        hook.remove()
    truth = router_logits[1].topk(2, dim=-1).indices[80:]  # [40, 2]
    guess = (seen["x0"] @ hf_model.model.layers[1].mlp.gate.weight.T).topk(2, dim=-1).indices[80:]
    expected = sum(len(set(g.tolist()) & set(t.tolist())) for g, t in zip(guess, truth)) / (2 * len(truth))
    settings = TrainSettings(ranks=(16,), max_epochs=5, learning_rate=1e-2, batch_tokens=32)
    entries = fit_expert_predictors(cfg, engine.executor.layers, x_tr, x_va, settings, min_free_recall=1.01)
    assert list(entries) == [0]
    entry = entries[0]
    assert entry.stats["free_guess_recall"] == pytest.approx(expected)
    if entry.mode == "predictor":  # trained (the free guess is below the bar) and used only if it beats it
        assert entry.stats["recall"] > expected
    pset = PredictorSet([LayerEntry(stats={"kind": "moe"}), LayerEntry(stats={"kind": "moe"})], experts=entries,
                        meta={"model_fingerprint": "m", "profile_fingerprint": "p", "model_id": "tiny"})
    save_predictors(pset, tmp_path / "e")
    back = load_predictors(tmp_path / "e", "m")
    router1 = engine.executor.layers[1].router
    assert torch.equal(guess_next_experts(back, 0, x_va[0], router1, 2), guess_next_experts(pset, 0, x_va[0], router1, 2))
    assert torch.equal(guess_next_experts(None, 0, x_va[0], router1, 2), (x_va[0] @ router1.T).topk(2, dim=-1).indices)


# --- the default model (slow) -------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_pipeline_exact_path_matches_profiler_and_stays_within_limit(smollm2_engine):
    """On SmolLM2 (SwiGLU): our exact-path perplexity equals the profiler's thresholded executor's,
    and the chosen predictors keep held-out perplexity within the limit."""
    from offline.calibration import build_calibration_set
    from offline.thresholds import ThresholdedExecutor, windows_perplexity
    from predictors.evaluate import split_into_windows
    engine = smollm2_engine
    calib = build_calibration_set(engine, max_tokens=1600)
    from offline.collect import collect_layer_activations
    acts = collect_layer_activations(engine, calib.train[:2], window_tokens=256)
    thresholds = torch.tensor([float(h.abs().flatten().quantile(0.45)) for _, (_, h) in sorted(acts.items())])
    profile = make_profile(engine, "threshold", thresholds)
    settings = TrainSettings(ranks=(16, 32), max_epochs=2)
    pset = build_predictors(engine, profile, calib, settings, progress=False)
    q = pset.meta["quality"]
    windows = split_into_windows(calib.held_out, 256)
    dense_ppl, _ = windows_perplexity(engine, engine.executor, windows)
    exact_ppl, _ = windows_perplexity(engine, ThresholdedExecutor(engine.executor, thresholds), windows)
    assert q["dense"]["perplexity"] == pytest.approx(dense_ppl, rel=1e-4)  # theirs: float32 log-softmax
    assert q["exact_path"]["perplexity"] == pytest.approx(exact_ppl, rel=1e-4)
    assert q["gated_increase"] <= q["limit"] + 1e-12
    for row in pset.entries:
        assert row.stats["recall"] >= 0.95 - 1e-9
