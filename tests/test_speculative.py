"""Exact speculative decoding (online/speculative) against plain decoding: greedy outputs identical
for each drafter and k = 1..8 (stop strings, EOS, the context limit), KV rollback, the lookup
drafter against a naive search, and speculative sampling's distribution against the verifier's
exact one (a chi-square test that rejects a wrong acceptance rule)."""
from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from helpers_tiny import build_tiny_chat_model
from online import Engine
from online.execution.fused_decode import FusedDecodeStep
from tandem.core.generate import LoopTimings, token_loop
from tandem.core.kv_cache import KVCache
from tandem.core.sampling import SamplingParams, sampling_probs
from online.speculative import LookupDrafter, SpeculationConfig, accept_sampled
from online.speculative.drafters import LookupProposer, SparseDrafter
from online.speculative.loop import SpecStats, speculative_token_loop
from online.speculative.policy import SpecPolicy
from tandem.core.errors import TandemError
from test_fused_decode import PROMPT, packed

VERIFY_THRESHOLDS = [0.02, 0.02]
DRAFT_THRESHOLDS = [0.04, 0.04]  # looser: the drafter disagrees now and then


def naive_lookup(history, k, max_n=3, min_n=1):
    for n in range(min(max_n, len(history)), min_n - 1, -1):
        suffix = history[-n:]
        for end in range(len(history) - 2, n - 2, -1):  # latest earlier occurrence with a continuation
            if history[end - n + 1:end + 1] == suffix:
                return history[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("alphabet", [2, 3, 5, 40])
def test_lookup_drafter_equals_a_naive_search(alphabet):
    rng = random.Random(alphabet)
    drafter, history = LookupDrafter(), []
    for _ in range(200):
        history.append(rng.randrange(alphabet))
        k = rng.randrange(1, 9)
        assert drafter.draft(history, k) == naive_lookup(history, k)


@pytest.fixture(scope="module")
def tiny_step(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    model, executor = packed(folder, "int4", thresholds=VERIFY_THRESHOLDS)
    return model, executor, FusedDecodeStep.build(model, executor)


def run_loop(model, executor, step, params, eos, max_total, spec=None):
    cache, timings = KVCache(model.cfg, 64), LoopTimings()
    if spec is None:
        events = token_loop(model, executor, cache, PROMPT, params, eos, max_total, timings, compiled=step)
        return [(e.token_id, e.finish_reason) for e in events], None
    name, k = spec
    drafter = LookupProposer() if name == "lookup" else SparseDrafter(step.with_thresholds(DRAFT_THRESHOLDS))
    stats = SpecStats(name)
    policy = SpecPolicy(k, (name,), adapt=False)
    events = speculative_token_loop(model, executor, cache, PROMPT, params, eos, max_total, timings, step,
                                    {name: drafter}, policy, stats)
    return [(e.token_id, e.finish_reason) for e in events], stats


@pytest.mark.parametrize("drafter", ["lookup", "sparse"])
def test_speculative_greedy_equals_plain_greedy_for_k_1_to_8(tiny_step, drafter):
    model, executor, step = tiny_step
    params = SamplingParams(max_new_tokens=40)
    plain, _ = run_loop(model, executor, step, params, set(), 64)
    tokens = [t for t, _ in plain]
    eos = {tokens[25]} if tokens[25] not in tokens[:25] else set()  # EOS inside the run
    plain_eos, _ = run_loop(model, executor, step, params, eos, 64)
    plain_ctx, _ = run_loop(model, executor, step, params, set(), len(PROMPT) + 17)  # context limit
    accepted = drafted = 0
    for k in range(1, 9):
        got, stats = run_loop(model, executor, step, params, set(), 64, (drafter, k))
        assert got == plain
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
        assert run_loop(model, executor, step, params, eos, 64, (drafter, k))[0] == plain_eos
        assert run_loop(model, executor, step, params, set(), len(PROMPT) + 17, (drafter, k))[0] == plain_ctx
    assert 0 < accepted < drafted  # both the accept and the reject path ran


def test_kv_rollback_after_a_rejection_and_reuse(tiny_step):
    model, _, step = tiny_step
    ref, spec = KVCache(model.cfg, 32), KVCache(model.cfg, 32)
    seq = PROMPT + [11, 12, 13, 14, 15, 16]
    want = [step(t, p, ref) for p, t in enumerate(seq)]
    for p, t in enumerate(PROMPT):
        step(t, p, spec)
    n = len(PROMPT)
    logits = step.step_many([11, 12, 99, 98, 97], n, spec)  # 12 accepted, 99.. rejected: rows n+2.. stale
    assert torch.equal(logits[:2], torch.stack(want[n:n + 2]))
    assert not torch.equal(spec.keys[:, :, n + 2], ref.keys[:, :, n + 2])
    got = [step(t, n + 2 + i, spec) for i, t in enumerate([13, 14, 15, 16])]  # rollback: pos = n + 2
    assert torch.equal(torch.stack(got), torch.stack(want[n + 2:]))
    end = len(seq)
    assert torch.equal(spec.keys[:, :, :end], ref.keys[:, :, :end])
    assert torch.equal(spec.values[:, :, :end], ref.values[:, :, :end])


def test_with_thresholds_shares_weights_and_keeps_its_own_counters(tiny_step):
    model, executor, step = tiny_step
    same, loose = step.with_thresholds(VERIFY_THRESHOLDS), step.with_thresholds(DRAFT_THRESHOLDS)
    caches = [KVCache(model.cfg, 16) for _ in range(3)]
    before = executor.counters.ffn_neurons_active
    for p, t in enumerate(PROMPT):
        a, b, c = step(t, p, caches[0]), same(t, p, caches[1]), loose(t, p, caches[2])
        assert torch.equal(a, b)
    assert torch.equal(caches[0].keys, caches[1].keys)
    verifier_active = executor.counters.ffn_neurons_active - before
    assert same.executor.counters.ffn_neurons_active == verifier_active
    assert loose.executor.counters.ffn_neurons_active < verifier_active
    with pytest.raises(TandemError):
        step.with_thresholds([0.1])


# --- speculative sampling ---------------------------------------------------------------------

SAMPLING = SamplingParams(temperature=0.05, top_k=4)
K = 2


def broken_ignores_q(draft, draft_probs, logits, params, generator):
    """A wrong rule: keeps a draft with probability p(d) (as if q were one-hot) and resamples from p."""
    out = []
    for i, d in enumerate(draft):
        p = sampling_probs(logits[i], params)
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(p[d]):
            out.append(d)
            continue
        out.append(int(torch.multinomial(p, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(sampling_probs(logits[len(draft)], params), 1, generator=generator)))
    return out


class Memo:
    """Verifier and drafter logits of one context, memoized by the tokens after the pending one."""

    def __init__(self, model, step, draft_step):
        self.model, self.step, self.draft_step = model, step, draft_step
        self.verify: dict = {}
        self.draft: dict = {}

    def _run(self, step, tokens):
        cache = KVCache(self.model.cfg, 32)
        for p, t in enumerate(PROMPT[:-1]):
            step(t, p, cache)
        return step.step_many([PROMPT[-1]] + list(tokens), len(PROMPT) - 1, cache)  # [1 + len, vocab]

    def verifier(self, tokens):  # rows for the pending token and each token after it
        if tokens not in self.verify:
            self.verify[tokens] = self._run(self.step, tokens)
        return self.verify[tokens]

    def q(self, tokens):  # the drafter's distribution after ``tokens``
        if tokens not in self.draft:
            self.draft[tokens] = sampling_probs(self._run(self.draft_step, tokens)[-1], SAMPLING)
        return self.draft[tokens]


def first_two_tokens(memo, rule, draws, generator):
    """(e1, e2) of one verify step per draw (e2 drawn from the exact p(.|e1) when the step emits one)."""
    counts: dict = {}
    for _ in range(draws):
        draft, rows = (), []
        for _ in range(K):
            q = memo.q(draft)
            rows.append(q)
            draft += (int(torch.multinomial(q, 1, generator=generator)),)
        out = rule(list(draft), torch.stack(rows), memo.verifier(draft), SAMPLING, generator)
        if len(out) == 1:
            p2 = sampling_probs(memo.verifier((out[0],))[1], SAMPLING)
            out.append(int(torch.multinomial(p2, 1, generator=generator)))
        key = (out[0], out[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def exact_pairs(memo):
    p1 = sampling_probs(memo.verifier(())[0], SAMPLING)
    pairs = {}
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = sampling_probs(memo.verifier((a,))[1], SAMPLING)
        for b in torch.nonzero(p2).flatten().tolist():
            pairs[(a, b)] = float(p1[a]) * float(p2[b])
    return pairs


def chi_square_p(counts, pairs, draws):
    assert set(counts) <= set(pairs), "a token outside the verifier's support was emitted"
    return pooled_chi_square({k: counts.get(k, 0) for k in pairs}, pairs, draws)


def pooled_chi_square(observed: dict, probs: dict, draws: int) -> float:
    """Chi-square p-value; cells expecting fewer than 5 draws are pooled into one."""
    total = sum(probs.values())
    cells = [[observed[k], probs[k] / total * draws] for k in probs]  # [observed, expected]
    big = [c for c in cells if c[1] >= 5]
    rest = [sum(c[0] for c in cells if c[1] < 5), sum(c[1] for c in cells if c[1] < 5)]
    if rest[1] >= 5:
        big.append(rest)
    else:  # too little to stand alone: part of the largest cell
        top = max(big, key=lambda c: c[1])
        top[0], top[1] = top[0] + rest[0], top[1] + rest[1]
    obs = [c[0] for c in big]
    exp = [c[1] * sum(obs) / sum(c[1] for c in big) for c in big]
    return chisquare(obs, exp).pvalue


def test_speculative_sampling_matches_the_verifier_distribution(tiny_step):
    model, _, step = tiny_step
    memo = Memo(model, step, step.with_thresholds([0.1, 0.1]))
    pairs = exact_pairs(memo)
    tv = 0.5 * float((sampling_probs(memo.verifier(())[0], SAMPLING) - memo.q(())).abs().sum())
    assert tv > 0.05  # the drafter differs enough from the verifier for a wrong rule to show
    draws = 6000
    right = first_two_tokens(memo, accept_sampled, draws, torch.Generator().manual_seed(1))
    wrong = first_two_tokens(memo, broken_ignores_q, draws, torch.Generator().manual_seed(1))
    assert chi_square_p(right, pairs, draws) > 1e-3
    assert chi_square_p(wrong, pairs, draws) < 1e-6


def test_deterministic_drafts_keep_the_verifier_distribution(tiny_step):
    model, _, step = tiny_step
    memo = Memo(model, step, step)
    p1 = sampling_probs(memo.verifier(())[0], SAMPLING)
    support = torch.nonzero(p1).flatten().tolist()
    draft = (min(support, key=lambda t: float(p1[t])),)  # a lookup draft of an unlikely token
    gen, counts, draws = torch.Generator().manual_seed(2), {}, 4000
    for _ in range(draws):
        t = accept_sampled(list(draft), None, memo.verifier(draft), SAMPLING, gen)[0]
        counts[t] = counts.get(t, 0) + 1
    assert set(counts) <= set(support)
    assert pooled_chi_square({t: counts.get(t, 0) for t in support}, {t: float(p1[t]) for t in support},
                             draws) > 1e-3


# --- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("spec_chat"))
    engine = Engine.load(str(folder), weight_format="int4")
    assert engine.decode_path == "fused"
    return engine


def test_engine_speculation_is_exact_across_stop_strings_eos_and_context(chat_engine, tmp_path_factory):
    e = chat_engine
    plain = e.generate("hello there", max_new_tokens=48, ignore_eos=True)
    stop = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 3]
    plain_stop = e.generate("hello there", max_new_tokens=48, ignore_eos=True, stop=[stop])
    e._draft_step = e.compiled_decode.with_thresholds([0.04, 0.04])  # a profile's draft thresholds
    for mode in ("lookup", "sparse", "auto"):
        for k in (1, 3, 8):
            got = e.generate("hello there", max_new_tokens=48, ignore_eos=True, speculate=mode, draft_tokens=k)
            assert (got.token_ids, got.text, got.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
            assert got.stats["speculate"] == mode and "speculate_reason" not in got.stats
            got = e.generate("hello there", max_new_tokens=48, ignore_eos=True, stop=[stop], speculate=mode,
                             draft_tokens=k)
            assert (got.text, got.finish_reason) == (plain_stop.text, plain_stop.finish_reason) == (got.text, "stop")
    e._draft_step = None
    small = Engine.load(str(e.model_path), weight_format="int4", context_length=20)
    want = small.generate("hello there", max_new_tokens=48, ignore_eos=True)
    got = small.generate("hello there", max_new_tokens=48, ignore_eos=True, speculate="lookup", draft_tokens=8)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "length"


def test_engine_speculation_off_on_the_module_path_says_why(chat_engine):
    modules = Engine.load(str(chat_engine.model_path), weight_format="int4", fused_decode=False)
    out = modules.generate("hello", max_new_tokens=4, speculate="lookup")
    assert out.stats["speculate"] == "off" and "fused decode step" in out.stats["speculate_reason"]
    with pytest.raises(TandemError, match="plan with a profile"):
        chat_engine.generate("hello", max_new_tokens=4, speculate="sparse")


@pytest.mark.parametrize("mode,k", [("fast", None), ("lookup", 0), ("lookup", 16), ("off", 4), ("lookup", True)])
def test_bad_speculation_values_are_one_line_errors(mode, k):
    with pytest.raises(TandemError):
        SpeculationConfig.parse(mode, k)


# --- draft thresholds from the profile ---------------------------------------------------------

def _profile(extra_tensors=None, search=(), activity="threshold"):
    from offline.profile_artifact import Profile
    from offline.thresholds import AbsHistogram
    hist = AbsHistogram(2)
    hist.add(0, torch.linspace(0.001, 1.0, 500)[None, :])
    hist.add(1, torch.linspace(0.002, 2.0, 500)[None, :])
    tensors = {"neuron_freq": torch.zeros(2, 4), "neuron_mean_abs": torch.zeros(2, 4),
               "hot_order": torch.zeros(2, 4, dtype=torch.long), "thresholds": torch.tensor([0.1, 0.2]),
               "layer_sparsity": torch.zeros(2), "abs_log2_histogram": hist.counts.float(), **(extra_tensors or {})}
    return Profile("fp", "m", activity, tensors, quality={"search": list(search)}), hist


def test_draft_thresholds_from_the_profile_or_derived_for_old_profiles():
    from offline.draft_thresholds import draft_thresholds
    points = [{"sparsity": 0.475, "increase": 0.12}, {"sparsity": 0.7, "increase": 0.35},
              {"sparsity": 0.2, "increase": 0.01}]
    old, hist = _profile(search=points)
    derived = draft_thresholds(old, max_quality_loss=0.2)
    want = hist.quantile_thresholds(0.475)  # the sparsest measured point within +20%
    assert derived.source.startswith("derived") and derived.uniform_sparsity == 0.475
    assert derived.thresholds == tuple(max(float(w), b) for w, b in zip(want, (0.1, 0.2)))
    new, _ = _profile({"draft_thresholds": torch.tensor([0.3, 0.05])}, points)
    stored = draft_thresholds(new)
    assert stored.source == "profile" and stored.thresholds == (pytest.approx(0.3), pytest.approx(0.2))
    with pytest.raises(TandemError):
        draft_thresholds(_profile(search=[{"sparsity": 0.7, "increase": 0.35}])[0], max_quality_loss=0.2)
    with pytest.raises(TandemError):
        draft_thresholds(_profile(activity="relu")[0])


@pytest.mark.slow
def test_real_model_lookup_and_auto_equal_plain_greedy_on_a_copying_prompt(smollm2_path):
    engine = Engine.load(str(smollm2_path), weight_format="int4")
    assert engine.decode_path == "fused"
    passage = "The keeper wrote down every ship that passed the point, the weather and the colour of the sea."
    prompt = [{"role": "user", "content": f"Repeat this sentence exactly: {passage}"}]
    plain = engine.generate(prompt, max_new_tokens=32)
    for mode in ("lookup", "auto"):
        got = engine.generate(prompt, max_new_tokens=32, speculate=mode, draft_tokens=6)
        assert got.token_ids == plain.token_ids and got.finish_reason == plain.finish_reason
    assert got.stats["draft_tokens"] > 0 or got.stats["plain_steps"] > 0
    lookup = engine.generate(prompt, max_new_tokens=32, speculate="lookup", draft_tokens=6)
    assert lookup.stats["acceptance_rate"] > 0  # a copying prompt: some drafts are the model's own tokens


def test_sparse_drafter_from_a_plans_profile_is_exact(tiny_model_dir, tmp_path):
    from helpers_plans import tiny_plan
    folder, _ = tiny_model_dir("llama")
    plan_dir = tiny_plan(folder, tmp_path, "rtx4090", 0)  # an all-CPU plan: the fused step decodes
    engine = Engine.load(str(folder), plan=plan_dir)
    assert engine.decode_path == "fused"
    plain = engine.generate(PROMPT, max_new_tokens=30, ignore_eos=True)
    got = engine.generate(PROMPT, max_new_tokens=30, ignore_eos=True, speculate="sparse", draft_tokens=4)
    assert got.token_ids == plain.token_ids and got.stats["speculate"] == "sparse" and got.stats["draft_tokens"] > 0
    info = engine.draft_thresholds_info
    assert info.source == "profile"
    assert all(d >= t for d, t in zip(info.thresholds, (s.threshold for s in engine.executor.splits)))


def test_engine_speculative_sampling_runs_and_is_reproducible_per_seed(chat_engine):
    e = chat_engine
    e._draft_step = e.compiled_decode.with_thresholds([0.04, 0.04])
    try:
        for mode in ("lookup", "sparse", "auto"):
            kwargs = dict(max_new_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, seed=3, speculate=mode)
            a, b = e.generate("hello there", **kwargs), e.generate("hello there", **kwargs)
            assert a.token_ids == b.token_ids and len(a.token_ids) == 24 and a.finish_reason == "length"
            assert a.stats["speculate"] == mode and all(0 <= t < e.config.vocab_size for t in a.token_ids)
    finally:
        e._draft_step = None


# --- the policy -----------------------------------------------------------------------------------

def test_expected_tokens_matches_a_simulation():
    from online.speculative.policy import expected_tokens
    rng = random.Random(0)
    for a, k in ((0.3, 1), (0.7, 4), (0.9, 8)):
        total = 0
        for _ in range(20000):
            n = 0
            while n < k and rng.random() < a:
                n += 1
            total += n + 1
        assert abs(total / 20000 - expected_tokens(a, k)) < 0.05 * expected_tokens(a, k)


def test_auto_uses_a_drafter_only_where_it_pays():
    from online.speculative.policy import SpecPolicy, expected_tokens

    def trained(draft_token_s, verify_s_per_token, accepted):
        policy = SpecPolicy(5, ("sparse",), allow_plain=True)
        for _ in range(3):
            policy.record_plain(0.03)
        for _ in range(10):
            policy.record_verify("sparse", 5, accepted, 6, 0.03 + 5 * verify_s_per_token, 5 * draft_token_s)
        return policy

    seen = set()
    for draft_s, per_token, accepted in ((0.028, 0.003, 5), (0.002, 0.003, 4), (0.002, 0.03, 1), (0.0, 0.001, 0)):
        policy = trained(draft_s, per_token, accepted)
        a = policy.drafters["sparse"].acceptance
        rates = {k: expected_tokens(a, k) / (policy.costs.estimate(k + 1) + k * draft_s) for k in range(1, 6)}
        best_k = max(rates, key=rates.get)
        name, k = policy.choose(10, {"sparse": 5})
        seen.add(name)
        if rates[best_k] > 1 / 0.03:
            assert (name, k) == ("sparse", best_k)
        else:
            assert (name, k) == (None, 0)
    assert seen == {None, "sparse"}  # both outcomes occur


def test_auto_never_probes_a_drafter_that_costs_a_plain_step_per_token():
    """rate = E(k) / (verify(k + 1) + k * draft) <= (k + 1) / ((k + 1) * plain) when draft >= plain and
    verify >= plain: such a drafter cannot pay, so once its probes measured that, auto stops trying it
    (one re-probe per REPROBE_MAX steps); a slow first call alone does not exclude it."""
    from online.speculative.policy import PROBE_VERIFIES, REPROBE_MAX, SpecPolicy
    policy = SpecPolicy(5, ("sparse",), allow_plain=True)
    for _ in range(3):
        policy.record_plain(0.004)
    assert policy.choose(10, {"sparse": 5})[0] == "sparse"
    policy.record_verify("sparse", 2, 2, 3, 0.006, 2 * 0.05)  # a cold first call: 12 plain steps per draft
    assert policy.choose(10, {"sparse": 5})[0] == "sparse"  # probed again: one sample is not evidence
    for _ in range(PROBE_VERIFIES - 1):  # perfect acceptance, but drafts that cost a plain step each
        policy.record_verify("sparse", 2, 2, 3, 0.006, 2 * 0.0041)
    assert policy.drafters["sparse"].draft_token_s == 0.0041  # the cold first sample is gone, not averaged in
    for _ in range(REPROBE_MAX):
        assert policy.choose(10, {"sparse": 5}) == (None, 0)
        policy.record_plain(0.004)
    assert policy.choose(10, {"sparse": 5})[0] == "sparse"  # after the longest wait: one retry


def test_auto_probes_short_and_backs_off_a_drafter_that_does_not_win():
    from online.speculative.policy import PROBE_DRAFT_TOKENS, REPROBE_EVERY, REPROBE_MAX, SpecPolicy
    policy = SpecPolicy(5, ("lookup",), allow_plain=True)
    verifies = []
    for step in range(1000):
        name, k = policy.choose(10, {"lookup": 5})
        if name is None:
            policy.record_plain(0.004)
            continue
        assert k <= PROBE_DRAFT_TOKENS  # probes (and what an unconvinced model picks) are short drafts
        verifies.append(step)
        policy.record_verify("lookup", k, 0, k + 1, 0.006, 0.0)  # never accepted: plain decode is better
    gaps = [b - a for a, b in zip(verifies, verifies[1:]) if b - a > 1]  # the retries after the first probes
    assert len(verifies) <= 10 and gaps[0] > REPROBE_EVERY
    assert all(b >= min(2 * a - 1, REPROBE_MAX) for a, b in zip(gaps, gaps[1:]))  # each wait doubles, up to the cap


def test_auto_leaves_out_a_sparse_drafter_that_reads_the_verifiers_bytes(tiny_step):
    from types import SimpleNamespace

    from online.speculative.setup import speculation_for
    model, executor, step = tiny_step
    assert step.thresholds_cut_reads()  # sparse down rows: a looser threshold reads fewer of them
    dense = step.with_thresholds(DRAFT_THRESHOLDS)
    for layer in dense._layers:  # as a plan with a GGUF down read whole (decode.c dense_down)
        layer.down = layer.up
    assert not dense.thresholds_cut_reads()
    engine = SimpleNamespace(compiled_decode=step, _draft_step=dense, decode_path="fused", decode_path_reason="")
    auto = speculation_for(engine, SpeculationConfig.parse("auto"))
    assert list(auto.drafters) == ["lookup"] and "cannot pay" in auto.reason
    assert list(speculation_for(engine, SpeculationConfig.parse("sparse")).drafters) == ["sparse"]  # as asked
    engine._draft_step = step.with_thresholds(DRAFT_THRESHOLDS)
    assert list(speculation_for(engine, SpeculationConfig.parse("auto")).drafters) == ["lookup", "sparse"]
