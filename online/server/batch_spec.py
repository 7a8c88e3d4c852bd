"""Speculative decoding inside the batching loop (``tandem serve --speculate``).

While few sequences run (at most ``max_seqs`` in the loop) a decoding sequence gets up to k drafted
tokens appended to its token in the same ``step_batch`` call (positions p..p+k, logits for all of
them); its verification (online/speculative/verify.py: greedy longest prefix + the verifier's
token, or the speculative-sampling rule with the sequence's generator) emits 1..k+1 tokens. Under
load it stays off: one step of T tokens costs about 1 + 0.4 (T - 1) single steps on a 2-core CPU,
so batching other streams is the better use of a weight read. ``step_batch`` is bit-identical to
the single-token step whatever else is in the call, so greedy output under speculation equals the
output without it. Sequences with logprobs or a grammar (DecodeOptions) decode token by token.

Rollback: the sequence's ``n_computed`` moves past the accepted drafts only; rows of rejected drafts
are overwritten before anything reads them, blocks allocated only for them are freed at once, and
prefix blocks are registered only below ``n_computed`` (accepted tokens).

Example::

    spec = BatchSpeculation.create(engine, engine.default_speculation, max_seqs=2)
    spec.describe()["mode"]          # "lookup" | "sparse" | "auto" | "off"
    k = spec.choose(seq, n_running)  # drafts set on seq.draft (0: a plain step)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from online.speculative.config import SpeculationConfig
from online.speculative.drafters import SparseDrafter
from online.speculative.setup import speculation_for
from online.speculative.verify import accept_greedy, accept_sampled

DEFAULT_SPEC_MAX_SEQS = 2


@dataclass
class SpecCounters:
    """Server-wide counters (read by /health and /metrics)."""
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    verify_tokens: int = 0  # tokens emitted by verify steps (accepted drafts + the verifier's own)
    plain_steps: int = 0  # steps of eligible sequences that drafted nothing (no match, policy, load)

    def as_dict(self) -> dict[str, Any]:
        return {"draft_tokens": self.drafted, "accepted_tokens": self.accepted, "verify_steps": self.verify_steps,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "tokens_per_verify_step": round(self.verify_tokens / self.verify_steps, 4) if self.verify_steps else 0.0,
                "plain_steps": self.plain_steps}


class PagedSparseDrafter(SparseDrafter):
    """The sparse self-drafter over a sequence's pool blocks: the draft step (the same packed
    weights at looser FFN thresholds) one token at a time through its own ``step_batch``. It writes
    draft KV at rows pos..pos+k-1, which the verify step rewrites before reading them."""

    def __init__(self, step: Any, pool: Any, seq: Any) -> None:
        super().__init__(step)
        self.pool, self.seq = pool, seq

    def draft_logits(self, token: int, pos: int, cache) -> torch.Tensor:
        table = np.asarray(self.seq.table, dtype=np.int32)
        return self.step.step_batch([token], [pos], [table], self.pool, [True])[0]  # [vocab]


@dataclass
class SeqSpec:
    """One sequence's drafters and policy (adaptive k, auto's choice), built on its first decode step."""
    drafters: dict
    policy: Any
    drafter: str | None = None  # the drafter of the pending draft
    draft_s: float = 0.0


class BatchSpeculation:
    """What the server speculates with (``mode``, ``reason``) and the per-step hooks of the loop."""

    def __init__(self, engine: Any, config: SpeculationConfig, max_seqs: int, mode: str, reason: str) -> None:
        self.engine, self.config, self.max_seqs = engine, config, max_seqs
        self.mode, self.reason = mode, reason
        self.counters = SpecCounters()

    @classmethod
    def create(cls, engine: Any, config: SpeculationConfig | None, max_seqs: int, fused: bool) -> "BatchSpeculation":
        """Off unless the engine's default speculation is on and the batch path is the fused step."""
        if config is None or not config.enabled:
            return cls(engine, SpeculationConfig(), max_seqs, "off", "not asked for (serve --speculate)")
        if not fused:
            return cls(engine, config, max_seqs, "off", "speculation needs the fused batched step; this model/plan "
                       "steps sequences through the module path")
        probe = speculation_for(engine, config)  # raises for an explicit sparse drafter that cannot be built
        if not probe.active:
            return cls(engine, config, max_seqs, "off", probe.reason)
        mode = config.mode
        why = (f"drafts for decoding sequences while at most {max_seqs} run; batching alone above that "
               f"(a T-token step costs ~1 + 0.4(T-1) single steps); logprobs/grammar and seeded sampled requests decode token "
               f"by token")
        return cls(engine, config, max_seqs, mode, why + (f"; {probe.reason}" if probe.reason else ""))

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def describe(self) -> dict[str, Any]:
        out = {"mode": self.mode, "reason": self.reason}
        if self.enabled:
            out |= {"draft_tokens": self.config.max_draft_tokens, "max_seqs": self.max_seqs, **self.counters.as_dict()}
        return out

    def eligible(self, seq: Any) -> bool:
        options = seq.decode_options
        plain = options is None or (not getattr(options, "logprobs", False) and not getattr(options, "top_logprobs", 0)
                                    and getattr(options, "constraint", None) is None and seq.state is None)
        # a seeded sampled request decodes token by token: whether it drafts depends on what else runs (max_seqs),
        # and drafting draws its random numbers differently, so its text would depend on the load
        params = seq.params
        seeded = params is not None and not params.greedy and params.seed is not None
        return self.enabled and plain and not seeded and seq.decoding and seq.n_generated > 0

    def _spec_of(self, seq: Any, pool: Any) -> SeqSpec:
        if seq.spec is None:
            setup = speculation_for(self.engine, self.config, seq.params)
            drafters = {name: (PagedSparseDrafter(d.step, pool, seq) if name == "sparse" else d)
                        for name, d in setup.drafters.items()}
            seq.spec = SeqSpec(drafters, setup.policy)
        return seq.spec

    def choose(self, seq: Any, pool: Any) -> int:
        """How many tokens to draft for ``seq`` this step (0: a plain step); sets ``seq.draft``."""
        seq.draft = []
        spec = self._spec_of(seq, pool)
        max_draft = min(seq.max_total_tokens - len(seq.tokens) - 1, spec.policy.max_draft_tokens)
        available = {n: d.available(seq.tokens, max_draft) for n, d in spec.drafters.items()} if max_draft > 0 else {}
        name, k = spec.policy.choose(max_draft, available)
        spec.drafter = name
        return k if name is not None else 0

    def draft(self, seq: Any, k: int) -> None:
        """Draft ``k`` tokens (blocks for positions up to pos+k are in place)."""
        spec = seq.spec
        t0 = time.perf_counter()
        pos = len(seq.tokens) - 1
        draft = spec.drafters[spec.drafter].propose(seq.tokens, pos, None, k, seq.params, seq.generator)
        spec.draft_s = time.perf_counter() - t0
        seq.draft, seq.draft_probs = list(draft.tokens), draft.probs

    def verify(self, seq: Any, logits: torch.Tensor, step_s: float) -> list[int]:
        """``logits`` [k+1, vocab] -> the emitted tokens; moves ``n_computed`` past the accepted drafts."""
        draft, spec = seq.draft, seq.spec
        out = (accept_greedy(draft, logits) if seq.params.greedy
               else accept_sampled(draft, seq.draft_probs, logits, seq.params, seq.generator))
        accepted = len(out) - 1
        seq.n_computed += accepted
        spec.policy.record_verify(spec.drafter, len(draft), accepted, len(draft) + 1, step_s, spec.draft_s)
        c = self.counters
        c.drafted, c.accepted, c.verify_steps, c.verify_tokens = (c.drafted + len(draft), c.accepted + accepted,
                                                                  c.verify_steps + 1, c.verify_tokens + len(out))
        seq.draft, seq.draft_probs = [], None
        return out

    def record_plain(self, seq: Any, step_s: float) -> None:
        """An eligible sequence took a plain one-token step (the cost auto compares against)."""
        if seq.spec is not None:
            seq.spec.policy.record_plain(step_s)
        self.counters.plain_steps += 1

