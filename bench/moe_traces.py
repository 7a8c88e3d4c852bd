"""Routing traces for the MoE bench: a tiny random Mixtral, and MoEfication of SmolLM2's FFNs.

Tiny random Mixtral (transformers' config class, 8 experts, top-2): each token's selected experts
per layer, and the prefetch guess for layer l+1 = layer l+1's router applied to layer l's FFN
input (the runtime's guess).

MoEfication of SmolLM2-135M (real weights, no MoE checkpoint exists offline): per layer, the 1536
FFN neurons are clustered into 8 experts of 192 neurons by co-activation (scikit-learn KMeans on
each neuron's L2-normalised |h| pattern over 768 calibration tokens, then a capacity-constrained
reassignment so every expert has the same size); a token goes to the 2 experts holding most of
its |h| mass (an oracle router). The prefetch guess for layer l+1 is a ridge least-squares map
from layer l's FFN input to layer l+1's per-expert mass shares, fitted on the calibration split
and applied to held-out tokens (top-2 of the prediction).

Example::

    trace = tiny_mixtral_trace(n_tokens=1024)
    trace, info = moefication_trace(fit_tokens=2000)
"""
from __future__ import annotations

import numpy as np
import torch

from tandem.core.ffn import DenseExecutor
from tandem.core.ffn.dense import route
from online.experts.packing import pack_expert
from .moe_sim import RoutingTrace

NUM_EXPERTS = 8
TOP_K = 2
CLUSTER_TOKENS = 768  # tokens whose |h| patterns the neurons are clustered on


class _Recorder(DenseExecutor):
    def __init__(self, cfg, layers) -> None:
        super().__init__(cfg, layers)
        self.ids: dict[int, list[torch.Tensor]] = {}
        self.guess: dict[int, list[torch.Tensor]] = {}

    def moe_forward(self, layer, x):
        self.ids.setdefault(layer, []).append(route(self.cfg, self.layers[layer], x)[0])
        if layer + 1 < self.cfg.num_layers:
            self.guess.setdefault(layer + 1, []).append(route(self.cfg, self.layers[layer + 1], x)[0])
        return super().moe_forward(layer, x)


def tiny_mixtral_trace(n_tokens: int = 1024, num_layers: int = 8, seed: int = 0) -> RoutingTrace:
    import tempfile
    import transformers as tf
    from tandem.core.generate import prefill
    from tandem.core.kv_cache import KVCache
    from tandem.core.loading.hf_loader import load_hf_folder
    from tandem.core.model.build import build_model
    torch.manual_seed(seed)
    hf_cfg = tf.MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=NUM_EXPERTS,
                              num_experts_per_tok=TOP_K, max_position_embeddings=512)
    with tempfile.TemporaryDirectory() as folder:
        tf.MixtralForCausalLM(hf_cfg).save_pretrained(folder)
        model, layers = build_model(load_hf_folder(folder))
    cfg = model.cfg
    recorder = _Recorder(cfg, layers)
    ids = torch.randint(0, cfg.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    for start in range(0, n_tokens, 256):
        prefill(model, recorder, KVCache(cfg, 256), ids[start:start + 256])
    trace_ids = [torch.cat(recorder.ids[i]) for i in range(num_layers)]
    guesses = [None] + [torch.cat(recorder.guess[i]) for i in range(1, num_layers)]
    return RoutingTrace("tiny random Mixtral", trace_ids, guesses, NUM_EXPERTS,
                        expert_nbytes=pack_expert(cfg, layers[0].experts[0], "int8").nbytes, d_model=cfg.hidden_size,
                        notes={"layers": num_layers, "hidden": cfg.hidden_size, "expert_ffn": cfg.moe_intermediate_size,
                               "tokens": n_tokens, "prompt": "uniformly random token ids, 256-token windows"})


# --- MoEfication ---------------------------------------------------------------------------------
def balanced_kmeans(features: np.ndarray, n_clusters: int, seed: int = 0) -> np.ndarray:
    """Cluster rows of ``features`` [n, f] into equal-size groups: KMeans, then a greedy
    capacity-constrained reassignment by distance to the centroids (a few refinement rounds)."""
    from sklearn.cluster import KMeans
    n = features.shape[0]
    capacity = n // n_clusters
    centers = KMeans(n_clusters=n_clusters, n_init=2, max_iter=100, random_state=seed).fit(features).cluster_centers_
    labels = np.zeros(n, dtype=np.int64)
    sq = (features ** 2).sum(1, keepdims=True)  # [n, 1]
    for _ in range(5):
        dist = sq - 2.0 * features @ centers.T + (centers ** 2).sum(1)[None]  # [n, C]
        order = np.argsort(dist, axis=None)
        labels[:] = -1
        counts = np.zeros(n_clusters, dtype=np.int64)
        for flat in order:
            i, c = divmod(int(flat), n_clusters)
            if labels[i] < 0 and counts[c] < capacity:
                labels[i], counts[c] = c, counts[c] + 1
        centers = np.stack([features[labels == c].mean(0) for c in range(n_clusters)])
    return labels


def moefication_trace(fit_tokens: int = 2000, trace_tokens: int | None = None, threads: int = 2,
                      ridge: float = 1.0) -> tuple[RoutingTrace, dict]:
    """The MoEfied SmolLM2 trace on held-out calibration text, and what the clustering achieved."""
    from offline.calibration import build_calibration_set
    from offline.collect import collect_layer_activations
    from online import Engine
    from tandem.core.ffn.weights import FFNWeights
    engine = Engine.load("smollm2", threads=threads)
    calib = build_calibration_set(engine)
    cfg = engine.config
    train = _cap(calib.train, fit_tokens)
    held = calib.held_out if trace_tokens is None else _cap(calib.held_out, trace_tokens)
    fit = collect_layer_activations(engine, train, window_tokens=256, dtype=torch.float16)
    test = collect_layer_activations(engine, held, window_tokens=256, dtype=torch.float16)
    n_layers, width = cfg.num_layers, cfg.intermediate_size
    masses_fit, masses_test, coverage, random_coverage = [], [], [], []
    rng = np.random.default_rng(0)
    for i in range(n_layers):
        h_fit = fit[i][1].float().abs().numpy()  # [N, F]
        sample = h_fit[rng.choice(h_fit.shape[0], min(CLUSTER_TOKENS, h_fit.shape[0]), replace=False)]  # [n, F]
        patterns = sample.T / (np.linalg.norm(sample.T, axis=1, keepdims=True) + 1e-12)  # [F, n]
        labels = balanced_kmeans(patterns, NUM_EXPERTS, seed=i)
        onehot = np.eye(NUM_EXPERTS, dtype=np.float32)[labels]  # [F, E]
        masses_fit.append(h_fit @ onehot)
        m_test = test[i][1].float().abs().numpy() @ onehot  # [T, E]
        masses_test.append(m_test)
        coverage.append(_top_share(m_test))
        random_onehot = np.eye(NUM_EXPERTS, dtype=np.float32)[rng.permutation(labels)]
        random_coverage.append(_top_share(test[i][1].float().abs().numpy() @ random_onehot))
    ids = [torch.from_numpy(np.argsort(-m, axis=1, kind="stable")[:, :TOP_K].copy()) for m in masses_test]
    guesses, same_layer = [None], []
    for i in range(1, n_layers):
        guesses.append(_ridge_guess(fit[i - 1][0], masses_fit[i], test[i - 1][0], ridge))
        same_layer.append(_recall(_ridge_guess(fit[i][0], masses_fit[i], test[i][0], ridge), ids[i]))
    expert_shape = FFNWeights(up=torch.zeros(width // NUM_EXPERTS, cfg.hidden_size),
                              down=torch.zeros(cfg.hidden_size, width // NUM_EXPERTS),
                              gate=torch.zeros(width // NUM_EXPERTS, cfg.hidden_size))
    trace = RoutingTrace("MoEfied SmolLM2-135M", ids, guesses, NUM_EXPERTS,
                         expert_nbytes=pack_expert(cfg, expert_shape, "int8").nbytes, d_model=cfg.hidden_size,
                         notes={"layers": n_layers, "fit_tokens": int(fit[0][0].shape[0]),
                                "trace_tokens": int(test[0][0].shape[0])})
    info = {"top2_mass_share": float(np.mean(coverage)), "random_partition_top2_mass_share": float(np.mean(random_coverage)),
            "same_layer_router_recall": float(np.mean(same_layer)),
            "fit_tokens": int(fit[0][0].shape[0]), "trace_tokens": int(test[0][0].shape[0])}
    return trace, info


def _cap(docs: list[list[int]], max_tokens: int) -> list[list[int]]:
    out, total = [], 0
    for doc in docs:
        if total >= max_tokens:
            break
        out.append(doc[: max_tokens - total])
        total += len(out[-1])
    return out


def _top_share(mass: np.ndarray) -> float:
    top = np.sort(mass, axis=1)[:, -TOP_K:].sum(1)
    return float((top / (mass.sum(1) + 1e-12)).mean())


def _ridge_guess(x_fit: torch.Tensor, mass_fit: np.ndarray, x_test: torch.Tensor, ridge: float) -> torch.Tensor:
    """Top-k of a ridge least-squares map x [N, d] (+ bias) -> per-expert mass shares [N, E]."""
    X = np.hstack([x_fit.float().numpy(), np.ones((x_fit.shape[0], 1), np.float32)]).astype(np.float64)
    Y = mass_fit / (mass_fit.sum(1, keepdims=True) + 1e-12)
    W = np.linalg.solve(X.T @ X + ridge * np.eye(X.shape[1]), X.T @ Y)  # [d+1, E]
    Xt = np.hstack([x_test.float().numpy(), np.ones((x_test.shape[0], 1), np.float32)])
    return torch.from_numpy(np.argsort(-(Xt @ W), axis=1, kind="stable")[:, :TOP_K].copy())


def _recall(guess: torch.Tensor, ids: torch.Tensor) -> float:
    return float((ids[:, :, None] == guess[:, None, :]).any(2).float().mean())
