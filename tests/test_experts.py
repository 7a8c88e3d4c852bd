"""MoE expert offloading against independent references: dense MoE and transformers for outputs,
a naive list-based LRU (+ prefetch) simulation on the dense routing trace for hits and misses,
the quantize module's own dequantization for packed experts, and the tier's byte accounting."""
from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from online import Engine
from tandem.core.ffn import DenseExecutor, MoELayerWeights
from tandem.core.ffn.dense import route
from online.execution.gpu_tier import GpuTier
from online.execution.hybrid import ExecutionSettings, HybridExecutor
from online.experts import ExpertCache, ExpertRuntime, MissCostModel, pack_expert, tier_bytes_needed, tier_forward
from online.experts.copier import ThreadCopier
from tandem.core.generate import LoopTimings, prefill, token_loop
from online.kernels.quantize import quantize
from tandem.core.kv_cache import KVCache
from tandem.core.loading.hf_loader import load_hf_folder
from tandem.core.model.build import build_model
from tandem.core.sampling import SamplingParams
from placement.hardware import PRESETS
from tandem.cli import main
from tandem.core.errors import TandemError

PROMPT = [5, 17, 42, 9, 77, 3, 101, 64]
NEW_TOKENS = 10
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(scope="module")
def mixtral8(tmp_path_factory):
    """A tiny random Mixtral with 8 experts (top-2) in 4 layers."""
    import transformers as tf
    torch.manual_seed(1)
    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=128)
    model = tf.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear greedy choices
    folder = tmp_path_factory.mktemp("tiny-mixtral8")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def models(mixtral8, tiny_model_dir):
    return {"mixtral8": mixtral8, "qwen2_moe": tiny_model_dir("qwen2_moe")}


def load(folder):
    return build_model(load_hf_folder(folder))


def cached(folder, slots, prefetch=True, policy="auto", fmt="fp32", pinned=None, budget=None, device="cpu"):
    """(model, executor, runtime, tier) with an expert cache in front of every MoE layer."""
    model, layers = load(folder)
    cfg = model.cfg
    need = tier_bytes_needed(cfg, layers, fmt, slots, pinned)
    tier = GpuTier.create(need if budget is None else budget, device)
    executor = HybridExecutor.build(cfg, layers, tier, ExecutionSettings(weight_format=fmt, sparse=False, threads=1))
    runtime = ExpertRuntime(cfg, layers, tier, weight_format=fmt, slots=slots, pinned=pinned,
                            prefetch=prefetch, miss_policy=policy, threads=1)
    executor.attach_experts(runtime)
    return model, executor, runtime, tier


def generate(model, executor, prompt=PROMPT, n=NEW_TOKENS) -> list[int]:
    cache = KVCache(model.cfg, 64)
    params = SamplingParams(max_new_tokens=n)
    return [ev.token_id for ev in token_loop(model, executor, cache, prompt, params, set(), 64, LoopTimings())]


def all_logits(model, executor, ids=PROMPT) -> torch.Tensor:
    return prefill(model, executor, KVCache(model.cfg, 64), ids, all_logits=True)


class RoutingRecorder(DenseExecutor):
    """Dense MoE that records (layer, expert ids [T, k], FFN input x [T, d]) of every MoE call."""

    def __init__(self, cfg, layers) -> None:
        super().__init__(cfg, layers)
        self.trace = []

    def moe_forward(self, layer, x):
        self.trace.append((layer, route(self.cfg, self.layers[layer], x)[0].clone(), x.clone()))
        return super().moe_forward(layer, x)


# --- outputs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mixtral8", "qwen2_moe"])
def test_generation_equals_dense_for_every_cache_setting(models, kind):
    folder, hf_model = models[kind]
    model, layers = load(folder)
    dense = DenseExecutor(model.cfg, layers)
    ref_tokens, ref_logits = generate(model, dense), all_logits(model, dense)
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(ref_logits, hf_logits, rtol=1e-4, atol=1e-5)
    n_experts = model.cfg.num_experts
    for slots in sorted({1, 2, n_experts // 2, n_experts - 1, n_experts}):  # the edges and the middle
        for prefetch in (True, False):
            for policy in ("copy", "cpu") if slots < n_experts else ("auto", "copy", "cpu"):
                model, executor, runtime, tier = cached(folder, slots, prefetch, policy)
                assert generate(model, executor) == ref_tokens, (slots, prefetch, policy)
                torch.testing.assert_close(all_logits(model, executor), ref_logits, rtol=1e-5, atol=1e-6)
                assert tier.peak_bytes <= tier.budget_bytes
    model, executor, runtime, _ = cached(folder, 2, True, "copy")
    torch.testing.assert_close(all_logits(model, executor), hf_logits, rtol=1e-4, atol=1e-5)
    assert runtime.counters()["copies"] > 0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_do_not_depend_on_the_cache(mixtral8, fmt):
    folder, _ = mixtral8
    model, layers = load(folder)
    ref = all_logits(model, DenseExecutor(model.cfg, layers))
    outputs, tokens = [], []
    for slots, prefetch, policy in [(0, False, "auto"), (1, True, "copy"), (3, False, "copy"), (8, True, "cpu")]:
        model, executor, runtime, _ = cached(folder, slots, prefetch, policy, fmt=fmt)
        outputs.append(all_logits(model, executor))
        tokens.append(generate(model, executor))
    for out, toks in zip(outputs[1:], tokens[1:]):
        torch.testing.assert_close(out, outputs[0], rtol=1e-4, atol=1e-4)  # CPU kernels vs tier dequantization
        assert toks == tokens[0]
    tolerance = {"int8": 0.03, "int4": 0.3}[fmt]
    assert float((outputs[0] - ref).abs().max() / ref.abs().max()) < tolerance


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("device", DEVICES)
def test_packed_expert_on_cpu_and_tier_match_reference(mixtral8, fmt, device):
    folder, _ = mixtral8
    model, layers = load(folder)
    cfg, w = model.cfg, layers[1].experts[3]
    packed = pack_expert(cfg, w, fmt, threads=1, pin=device == "cuda")
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))

    def deq(t, f):  # the quantize module's own numpy dequantization
        return torch.from_numpy(quantize(t.float().numpy(), f).dequantize().copy())
    down_fmt = "fp32" if fmt == "fp32" else "int8"
    up, gate, down = deq(w.up, fmt), deq(w.gate, fmt), deq(w.down.T.contiguous(), down_fmt).T
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(packed.cpu_forward(x), expected, rtol=1e-4, atol=1e-5)
    slot = packed.host.to(device)
    y = tier_forward(cfg, packed.layout, slot, x.to(device)).cpu()
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-5)
    assert packed.host.numel() == packed.nbytes and packed.host.dtype == torch.uint8


# --- the cache against a naive LRU --------------------------------------------------------------
def lru_touch(lru: list, needed: list, pinned) -> list:
    """The reference's lookup step: pinned or listed experts are hits (listed ones move to the
    most-recent end, in ascending order); returns the misses, ascending."""
    missed = []
    for e in needed:
        if e in pinned or e in lru:
            if e in lru:
                lru.remove(e)
                lru.append(e)
        else:
            missed.append(e)
    return missed


def naive_lru(trace, slots, pinned, prefetch_routers=None, next_layer=None, k=2):
    """Reference: per layer a Python list (LRU first). Hits: ascending experts made most recent;
    misses ascending, appended after evicting the front when full. Prefetch: the next layer's
    top-k on this layer's x, ranked by tokens, best rank, id; at most slots + pinned candidates,
    inserted unless cached, evicting the least recent expert that is not a candidate."""
    lists = {}
    hits = misses = guessed = guessed_total = 0
    guesses = {}
    for layer, ids, x in trace:
        lru = lists.setdefault(layer, [])
        if layer in guesses:
            g = guesses.pop(layer)
            guessed += sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, g))
            guessed_total += ids.numel()
        needed = sorted(set(ids.flatten().tolist()))
        missed = lru_touch(lru, needed, pinned.get(layer, ()))
        hits += len(needed) - len(missed)
        misses += len(missed)
        for e in missed:
            if slots:
                if len(lru) == slots:
                    lru.pop(0)
                lru.append(e)
        target = next_layer.get(layer) if prefetch_routers else None
        if target is None:
            continue
        probs = torch.softmax(x @ prefetch_routers[target].T, dim=-1)
        g = probs.topk(k, dim=-1).indices
        guesses[target] = g
        score = {}
        for row in g.tolist():
            for rank, e in enumerate(row):
                c, best = score.get(e, (0, k))
                score[e] = (c + 1, min(best, rank))
        candidates = sorted(score, key=lambda e: (-score[e][0], score[e][1], e))[:slots + len(pinned.get(target, ()))]
        nxt = lists.setdefault(target, [])
        for e in candidates:
            if e in pinned.get(target, ()) or e in nxt:
                continue
            if len(nxt) < slots:
                nxt.append(e)
                continue
            victims = [v for v in nxt if v not in candidates]
            if victims:
                nxt.remove(victims[0])
                nxt.append(e)
    return hits, misses, guessed, guessed_total, lists


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("with_pinned", [False, True])
def test_hits_and_misses_equal_a_naive_lru_on_the_routing_trace(mixtral8, prefetch, with_pinned):
    folder, _ = mixtral8
    model, layers = load(folder)
    cfg = model.cfg
    recorder = RoutingRecorder(cfg, layers)
    ref_tokens = generate(model, recorder)
    routers = {i: w.router for i, w in enumerate(layers) if isinstance(w, MoELayerWeights)}
    next_layer = {i: i + 1 for i in range(cfg.num_layers - 1)}
    pinned = {0: [2], 2: [0, 5]} if with_pinned else {}
    mask = [[e in pinned.get(i, ()) for e in range(cfg.num_experts)] for i in range(cfg.num_layers)]
    for slots in range(0, cfg.num_experts - 1):
        model, executor, runtime, tier = cached(folder, slots, prefetch, "copy", pinned=mask)
        assert generate(model, executor) == ref_tokens
        hits, misses, guessed, guessed_total, lists = naive_lru(recorder.trace, slots, pinned,
                                                                routers if prefetch else None, next_layer)
        got = runtime.counters()
        assert (got["hits"], got["misses"]) == (hits, misses), slots
        for i, cache in runtime.caches.items():
            assert cache.cached() == lists.get(i, [])
            assert cache.pinned == frozenset(pinned.get(i, ()))
            assert not cache.pinned & set(cache.cached())
        if prefetch:
            assert (got["guessed_hits"], got["guessed_total"]) == (guessed, guessed_total)
        assert tier.used_bytes == tier.budget_bytes and tier.peak_bytes <= tier.budget_bytes


def test_expert_cache_on_random_traces_matches_naive_lru():
    rng = random.Random(0)
    tier = GpuTier.create(1 << 20, "cpu")
    copier = ThreadCopier()
    for trial in range(40):
        n_experts, slots = rng.randint(2, 10), rng.randint(0, 6)
        pinned = set(rng.sample(range(n_experts), rng.randint(0, n_experts // 3)))
        slots = min(slots, n_experts - len(pinned))
        hosts = {e: torch.full((64,), e, dtype=torch.uint8) for e in range(n_experts)}
        cache = ExpertCache(trial, slots, 64, tier, copier, pinned={e: hosts[e] for e in pinned})
        lru, hits, misses = [], 0, 0
        for _ in range(60):
            needed = sorted(rng.sample(range(n_experts), rng.randint(1, min(3, n_experts))))
            missed = lru_touch(lru, needed, pinned)
            hits += len(needed) - len(missed)
            misses += len(missed)
            for e in needed:
                assert cache.lookup(e) == (e in pinned or e in cache.cached())
            for e in missed:
                if not slots:
                    continue
                victim = lru.pop(0) if len(lru) == slots else None
                lru.append(e)
                assert cache.choose_victim() == victim
                assert cache.insert(e, hosts[e]) == victim
            assert cache.cached() == lru
            for e in lru + sorted(pinned):  # every buffer holds its own expert's bytes
                assert int(cache.ready_buffer(e)[0]) == e
        assert (cache.hits, cache.misses) == (hits, misses)
    assert tier.peak_bytes <= tier.budget_bytes
    copier.close()


# --- budget and policy --------------------------------------------------------------------------
def test_gpu_tier_budget_is_never_exceeded(mixtral8):
    folder, _ = mixtral8
    model, layers = load(folder)
    need = tier_bytes_needed(model.cfg, layers, "fp32", 3)
    expert_bytes = pack_expert(model.cfg, layers[0].experts[0], "fp32").nbytes
    assert need == model.cfg.num_layers * 3 * expert_bytes  # independent: slots x packed size
    assert expert_bytes >= 3 * 64 * 48 * 4
    with pytest.raises(TandemError, match="GPU budget too small"):
        cached(folder, 3, budget=need - 1)
    model, executor, runtime, tier = cached(folder, 3, budget=need, policy="copy")
    generate(model, executor)
    assert tier.used_bytes == need and tier.peak_bytes == need
    with pytest.raises(TandemError, match="GPU budget too small"):
        Engine.load(str(folder), expert_slots=3, gpu_budget_bytes=need - 1)
    runtime.close()


def test_fit_to_budget_drops_slots_instead_of_overflowing(mixtral8):
    folder, _ = mixtral8
    model, layers = load(folder)
    expert_bytes = pack_expert(model.cfg, layers[0].experts[0], "fp32").nbytes
    tier = GpuTier.create(expert_bytes * 9, "cpu")  # 4 layers x 3 slots wanted, room for 9
    runtime = ExpertRuntime(model.cfg, layers, tier, slots=3, fit_to_budget=True, threads=1)
    assert sorted(c.num_slots for c in runtime.caches.values()) == [2, 2, 2, 3]
    assert tier.used_bytes == 9 * expert_bytes


def test_miss_cost_model_follows_the_bandwidths():
    nbytes, params, d = 176_160_768, 176_160_768, 4096  # a Mixtral-8x7B expert at 1 byte per weight
    for name in ("rtx4090", "t4"):
        hw = PRESETS[name]
        cost = MissCostModel.from_hardware(hw)
        for tokens in (1, 4, 64, 512):
            copy_s = (nbytes + 8 * tokens * d) / hw.h2d_bandwidth_bytes_per_s + max(
                nbytes / hw.gpu_bandwidth_bytes_per_s, 2 * params * tokens / hw.gpu_matmul_flops)
            cpu_s = max(nbytes / hw.cpu_bandwidth_bytes_per_s, 2 * params * tokens / hw.cpu_matmul_flops)
            assert cost.should_copy(nbytes, params, tokens, d) == (copy_s < cpu_s)
    assert not MissCostModel.from_hardware(PRESETS["rtx4090"]).should_copy(nbytes, params, 1, d)  # Fiddler
    assert MissCostModel.from_hardware(PRESETS["rtx4090"]).should_copy(nbytes, params, 512, d)
    cpu_tier = MissCostModel.from_hardware(PRESETS["cpu-only"])
    assert not any(cpu_tier.should_copy(nbytes, params, t, d) for t in (1, 64, 4096))


def test_auto_policy_on_a_cpu_tier_computes_misses_in_place(mixtral8):
    folder, _ = mixtral8
    model, executor, runtime, _ = cached(folder, 2, prefetch=False, policy="auto")
    generate(model, executor)
    got = runtime.counters()
    assert got["copies"] == 0 and got["hits"] == 0 and got["cpu_expert_tokens"] > 0


# --- engine and CLI -----------------------------------------------------------------------------
def run_json(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_cli_generate_with_expert_slots(capsys, mixtral8, tiny_model_dir):
    folder, dense = str(mixtral8[0]), str(tiny_model_dir("llama")[0])
    capsys.readouterr()
    base = ["generate", "--model", folder, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8",
            "--json", "--threads", "1"]
    ref = run_json(capsys, *base)
    keys = ("expert_hit_rate", "prefetch_recall", "prefetch_precision", "bytes_moved_per_token", "experts_cpu_per_token")
    for extra in (["--expert-slots", "2"], ["--expert-slots", "2", "--no-prefetch"], ["--expert-slots", "8"],
                  ["--expert-slots", "1", "--gpu-device", "cpu"]):
        out = run_json(capsys, *base, *extra)
        assert out["token_ids"] == ref["token_ids"], extra
        assert all(k in out for k in keys), extra
        assert 0.0 <= out["expert_hit_rate"] <= 1.0
        assert (out["prefetch_recall"] is None) == ("--no-prefetch" in extra)
    assert out["experts_cpu_per_token"] > 0
    for argv, fragment in ((["generate", "--model", dense, "--prompt-ids", "1,2", "--expert-slots", "2"], "needs a MoE"),
                           (["generate", "--model", folder, "--prompt-ids", "1,2", "--expert-slots", "-1"], ">= 0")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0] and "Traceback" not in err[0]


def test_engine_stats_count_what_the_runtime_did(mixtral8):
    folder, _ = mixtral8
    engine = Engine.load(str(folder), expert_slots=8, prefetch=False, threads=1)
    out = engine.generate(PROMPT, max_new_tokens=6)
    runtime = engine.executor.experts
    got = runtime.counters()
    steps = len(PROMPT) + 5  # prefill tokens + decode steps
    assert out.stats["expert_hit_rate"] == 0.0  # the cpu tier computes misses in place: nothing cached
    layers = engine.config.num_layers
    assert out.stats["experts_cpu_per_token"] == round(got["cpu_expert_tokens"] / steps, 3)
    assert got["cpu_expert_tokens"] == steps * layers * engine.config.num_experts_per_tok


def test_plan_slots_and_pinned_experts_reach_the_runtime(mixtral8, tmp_path):
    import numpy as np
    from offline.profile_artifact import Profile, save_profile
    from tandem.core.loading import load_checkpoint
    from placement.hardware import HardwareProfile
    from placement.plan import save_plan
    from placement.planner import make_plan
    from placement.settings import PlanSettings
    folder = str(mixtral8[0])
    ckpt = load_checkpoint(folder)
    cfg = ckpt.config
    n_layers, n_experts, width = cfg.num_layers, cfg.num_experts, cfg.intermediate_size
    freq = np.array([0.9, 0.5, 0.2, 0.15, 0.1, 0.08, 0.04, 0.03])
    expert_freq = torch.tensor(np.stack([np.roll(freq / freq.sum() * 2, i) for i in range(n_layers)]), dtype=torch.float32)
    tensors = {"neuron_freq": torch.zeros(n_layers, width), "hot_order": torch.arange(width).repeat(n_layers, 1),
               "neuron_mean_abs": torch.zeros(n_layers, width), "thresholds": torch.zeros(n_layers),
               "layer_sparsity": torch.zeros(n_layers), "expert_freq": expert_freq,
               "expert_repeat": torch.full((n_layers,), 0.3)}
    profile = Profile(model_fingerprint=ckpt.fingerprint, model_id=ckpt.model_id, activity="threshold", tensors=tensors)
    save_profile(profile, tmp_path / "profile")
    hardware = HardwareProfile(name="tiny-gpu", gpu_memory_bytes=2**30, gpu_bandwidth_bytes_per_s=10e9,
                               gpu_matmul_flops=1e15, cpu_bandwidth_bytes_per_s=1e9, cpu_matmul_flops=1e15,
                               h2d_bandwidth_bytes_per_s=2e9, layer_sync_latency_s=4e-6, cpu_threads=2)
    plan = make_plan(cfg, model_fingerprint=ckpt.fingerprint, model_id=ckpt.model_id, profile=profile, hardware=hardware,
                     gpu_budget_bytes=200_000, settings=PlanSettings(bytes_per_weight=1.0625, context_tokens=64,
                                                                     gpu_reserve_bytes=1000))
    save_plan(plan, tmp_path / "plan")
    assert plan.expert_pinned.any() and plan.expert_cache_slots.sum() > 0
    engine = Engine.load(folder, plan=tmp_path / "plan", threads=1, gpu_device="cpu")
    runtime = engine.executor.experts
    for i, cache in runtime.caches.items():
        assert cache.pinned == frozenset(plan.expert_pinned[i].nonzero().flatten().tolist())
        assert cache.num_slots == int(plan.expert_cache_slots[i])
    out = engine.generate(PROMPT, max_new_tokens=8)
    assert runtime.tier.peak_bytes <= runtime.tier.budget_bytes == 200_000
    assert out.stats["expert_hit_rate"] > 0  # pinned experts are hits
    reference = Engine.load(folder, weight_format="int8", expert_slots=0, threads=1).generate(PROMPT, max_new_tokens=8)
    assert out.token_ids == reference.token_ids
    # the plan's attention/KV and output layer fill the rest of the budget, so an override can only shrink here
    override = Engine.load(folder, plan=tmp_path / "plan", threads=1, gpu_device="cpu", expert_slots=0)
    assert all(c.num_slots == 0 for c in override.executor.experts.caches.values())
    assert override.generate(PROMPT, max_new_tokens=8).token_ids == reference.token_ids
    with pytest.raises(TandemError, match="GPU budget too small"):
        Engine.load(folder, plan=tmp_path / "plan", threads=1, gpu_device="cpu", expert_slots=8)
