"""Verification: which drafted tokens the verifier's logits accept, and the token that follows.

Greedy: the longest prefix of the draft that equals the verifier's argmax, then the verifier's
own next token. Sampling (Leviathan et al. 2023, Chen et al. 2023): draft token d drawn from q is
kept with probability min(1, p(d) / q(d)); on the first rejection the next token is drawn from
norm(max(p - q, 0)); if all k are kept, one more is drawn from the verifier's last row. p and q
are ``sampling_probs`` of the verifier's and the drafter's logits (the user's temperature, top-k
and top-p applied to both), so each emitted token is distributed exactly as the verifier's.

Example::

    logits = step.step_many([pending] + draft, pos, cache)      # [k+1, vocab]
    tokens = accept_greedy(draft, logits)                       # accepted drafts + 1 verifier token
    tokens = accept_sampled(draft, None, logits, params, gen)   # q one-hot (a lookup draft)
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from tandem.core.sampling import SamplingParams, sample_from, sampling_probs, uniform


def accept_greedy(draft: Sequence[int], logits: torch.Tensor) -> list[int]:
    """``logits`` [len(draft) + 1, vocab] of the verify step -> the emitted tokens (1..k+1)."""
    choices = torch.argmax(logits, dim=-1).tolist()  # [k+1]: the verifier's token after each prefix
    out: list[int] = []
    for d, v in zip(draft, choices):
        if d != v:
            break
        out.append(d)
    out.append(choices[len(out)])
    return out


def accept_sampled(draft: Sequence[int], draft_probs: torch.Tensor | None, logits: torch.Tensor,
                   params: SamplingParams, generator: Any) -> list[int]:
    """Speculative sampling. ``draft_probs`` [k, vocab]: the drafter's q rows the drafts were drawn
    from (``None``: deterministic drafts, q one-hot). Returns the emitted tokens (1..k+1)."""
    out: list[int] = []
    for i, d in enumerate(draft):
        p = sampling_probs(logits[i], params)  # [vocab]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = uniform(generator)
        if q_d > 0.0 and u * q_d < float(p[d]):  # u < p(d) / q(d)
            out.append(int(d))
            continue
        residual = p.double().clone()  # [vocab]
        if draft_probs is None:
            residual[d] = 0.0
        else:
            residual = (residual - draft_probs[i].double()).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: the residual is empty, p itself is the answer
            residual, total = p.double(), float(p.sum())
        out.append(sample_from(residual / total, generator))
        return out
    p = sampling_probs(logits[len(draft)], params)  # [vocab]
    out.append(sample_from(p, generator))
    return out
