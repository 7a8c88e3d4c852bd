"""Adaptive k and the ``auto`` choice, from measured step costs and the running acceptance rate.

With per-position acceptance a (a drafted token is kept given the ones before it were), k drafts
yield E(k) = (1 - a^(k+1)) / (1 - a) tokens per verify step (the accepted prefix plus the
verifier's own token) at a cost of k drafted tokens plus one (k+1)-token verify step. The policy
picks the k in 1..K with the most tokens per second, and (``auto``) plain decode, a one-token
step, when no drafter beats it. Costs are exponential moving averages of what was measured; a
verify size not seen yet is interpolated between the sizes seen (T = 1 is the plain step).

Example::

    policy = SpecPolicy(max_draft_tokens=5, drafters=("lookup",))
    choice = policy.choose(max_tokens=remaining - 1, available={"lookup": 3})   # ("lookup", 3) or (None, 0)
    policy.record_verify("lookup", drafted=3, accepted=2, verify_tokens=4, seconds=0.02, draft_seconds=0.0)
"""
from __future__ import annotations

from dataclasses import dataclass, field

EMA_WEIGHT = 0.3  # weight of a new measurement
ACCEPT_DECAY = 0.9  # per verify step: how fast old acceptance evidence fades
PROBE_VERIFIES = 2  # auto tries each drafter this many times before trusting the model
PROBE_DRAFT_TOKENS = 2  # drafts per probe: a probe that fails costs a short verify, not a long one
REPROBE_EVERY = 24  # auto retries a drafter it dropped after this many steps without it ...
REPROBE_MAX = 384  # ... doubling the wait after each retry that did not win it back, up to this


@dataclass
class StepCosts:
    """Seconds per step by the number of tokens it ran (T = 1: the plain single-token step)."""
    seconds: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def record(self, tokens: int, seconds: float) -> None:
        """The first measurement of a size stands only until the second replaces it (a first call
        pays for binding the cache and sizing scratch); later ones enter the moving average."""
        n = self.counts.get(tokens, 0)
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if n < 2 else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * seconds
        self.counts[tokens] = n + 1

    def estimate(self, tokens: int) -> float | None:
        """Measured, interpolated, or extrapolated (along the last two sizes; proportional from one)."""
        if tokens in self.seconds:
            return self.seconds[tokens]
        known = sorted(self.seconds)
        if not known:
            return None
        if len(known) == 1:
            return self.seconds[known[0]] * tokens / known[0]
        below = [t for t in known if t < tokens]
        above = [t for t in known if t > tokens]
        lo, hi = (below[-1], above[0]) if below and above else ((known[-2], known[-1]) if below else (known[0], known[1]))
        slope = (self.seconds[hi] - self.seconds[lo]) / (hi - lo)
        return max(self.seconds[lo] + slope * (tokens - lo), 1e-9)


@dataclass
class DrafterStats:
    accepted: float = 0.0  # decayed count of kept drafts
    trials: float = 0.0  # decayed count of kept drafts + rejections
    draft_token_s: float | None = None  # EMA seconds per drafted token
    verifies: int = 0
    steps_since_used: int = 0
    reprobe_every: int = REPROBE_EVERY  # auto: steps without this drafter before it is tried again

    @property
    def acceptance(self) -> float:
        """Per-position acceptance, with a uniform prior."""
        return (self.accepted + 1.0) / (self.trials + 2.0)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens per verify step with k drafts at per-position acceptance ``acceptance``."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class SpecPolicy:
    """``adapt``: pick k (and, in auto, the drafter or plain decode) by the model; else always the
    first drafter with a draft, as many tokens as it has up to K: no decision depends on timing, so
    seeded sampling is reproducible. ``allow_plain``: auto mode, where plain decode competes."""

    def __init__(self, max_draft_tokens: int, drafters: tuple[str, ...], adapt: bool = True,
                 allow_plain: bool = False) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.adapt, self.allow_plain = adapt, allow_plain
        self.costs = StepCosts()
        self.drafters = {name: DrafterStats() for name in drafters}
        self.plain_steps = 0
        self.steps_since_plain = 0

    def rate(self, name: str, k: int) -> float | None:
        """Modeled tokens per second drafting k with ``name`` (None while a cost is unknown)."""
        stats = self.drafters[name]
        verify_s = self.costs.estimate(k + 1)
        if verify_s is None or stats.draft_token_s is None:
            return None
        return expected_tokens(stats.acceptance, k) / (verify_s + k * stats.draft_token_s)

    def best_k(self, name: str, limit: int) -> tuple[int, float | None]:
        rates = [(self.rate(name, k), k) for k in range(1, limit + 1)]
        if not self.adapt or any(r is None for r, _ in rates):
            return limit, None
        r, k = max(rates, key=lambda rk: (rk[0], -rk[1]))
        return k, r

    def choose(self, max_tokens: int, available: dict[str, int]) -> tuple[str | None, int]:
        """``available``: drafter -> how many tokens it can draft now (lookup: the match length;
        sparse: K). Returns (drafter, k) or (None, 0) for a plain step."""
        limit = min(self.max_draft_tokens, max_tokens)
        options = {n: min(limit, a) for n, a in available.items() if n in self.drafters and min(limit, a) >= 1}
        if not options:
            return None, 0
        if not self.allow_plain or not self.adapt:  # fixed k: the first drafter that has a draft
            name = next(iter(options))
            return name, self.best_k(name, options[name])[0]
        plain_s = self.costs.estimate(1) if 1 in self.costs.seconds else None
        if plain_s is None or self.plain_steps < PROBE_VERIFIES or self.steps_since_plain >= REPROBE_EVERY:
            return None, 0  # measure (and now and then re-measure) the plain step
        for name, limit_k in options.items():  # explore: measure each drafter before trusting the model
            stats = self.drafters[name]
            if (stats.verifies >= PROBE_VERIFIES and stats.draft_token_s is not None and stats.draft_token_s >= plain_s
                    and stats.steps_since_used < REPROBE_MAX):
                continue  # a drafted token costing a plain step never pays (a verify costs at least one): probed
                # only at the longest re-probe wait, in case what made it slow (contention) has passed
            if stats.verifies < PROBE_VERIFIES or stats.steps_since_used >= stats.reprobe_every:
                if stats.verifies >= PROBE_VERIFIES:  # a retry: the next one waits longer unless this wins
                    stats.reprobe_every = min(2 * stats.reprobe_every, REPROBE_MAX)
                return name, min(limit_k, PROBE_DRAFT_TOKENS)
        best: tuple[float, str | None, int] = (1.0 / plain_s, None, 0)
        for name, limit_k in options.items():
            k, r = self.best_k(name, limit_k)
            if r is not None and r > best[0]:
                best = (r, name, k)
        if best[1] is not None:
            self.drafters[best[1]].reprobe_every = REPROBE_EVERY  # it pays again: retried promptly if dropped
        return best[1], best[2]

    def record_plain(self, seconds: float) -> None:
        self.costs.record(1, seconds)
        self.plain_steps += 1
        self.steps_since_plain = 0
        for stats in self.drafters.values():
            stats.steps_since_used += 1

    def record_verify(self, name: str, drafted: int, accepted: int, verify_tokens: int, seconds: float,
                      draft_seconds: float) -> None:
        self.costs.record(verify_tokens, seconds)
        stats = self.drafters[name]
        stats.accepted = ACCEPT_DECAY * stats.accepted + accepted
        stats.trials = ACCEPT_DECAY * stats.trials + accepted + (1 if accepted < drafted else 0)
        per_token = draft_seconds / max(drafted, 1)
        # as StepCosts: the first measurement (the drafter's first call binds its cache and sizes its
        # scratch) stands only until the second replaces it; later ones enter the moving average
        stats.draft_token_s = per_token if stats.draft_token_s is None or stats.verifies < 2 else (
            (1 - EMA_WEIGHT) * stats.draft_token_s + EMA_WEIGHT * per_token)
        stats.verifies += 1
        self.steps_since_plain += 1
        for other_name, other in self.drafters.items():
            other.steps_since_used = 0 if other_name == name else other.steps_since_used + 1
