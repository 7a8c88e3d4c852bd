"""Drafters behind one interface: ``propose(history, pos, cache, k, params, generator) -> Draft``.

``history``: prompt + emitted tokens; its last token is the pending one, not yet in the KV cache,
at position ``pos``. A draft is the k tokens after it and, for a drafter that samples, the rows of
q it sampled them from.

Example::

    drafter = SparseDrafter(step.with_thresholds(draft_thresholds))
    draft = drafter.propose(history, pos, cache, 4, params, generator)   # draft.tokens, draft.probs
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.sampling import SamplingParams, greedy_token, sample_from, sampling_probs
from .lookup import LookupDrafter


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), vocab] q rows; None: deterministic (q one-hot)


class LookupProposer:
    """Prompt lookup: no weights, writes nothing."""
    name = "lookup"

    def __init__(self) -> None:
        self.lookup = LookupDrafter()

    def available(self, history: list[int], k: int) -> int:
        return len(self.lookup.draft(history, k))

    def propose(self, history, pos, cache, k, params: SamplingParams, generator) -> Draft:
        return Draft(self.lookup.draft(history, k), None)


class SparseDrafter:
    """Self-drafting through the single-token step at looser FFN thresholds (``step``: a
    FusedDecodeStep sharing the verifier's packed weights). It writes draft keys/values at
    ``pos..pos+k-1`` of the shared cache; the verify step rewrites every one of those rows before
    it reads it, so the verifier never sees a drafted key."""
    name = "sparse"

    def __init__(self, step) -> None:
        self.step = step

    def available(self, history: list[int], k: int) -> int:
        return k

    @torch.inference_mode()
    def propose(self, history, pos, cache, k, params: SamplingParams, generator) -> Draft:
        token, tokens, rows = history[-1], [], []
        for i in range(k):
            logits = self.draft_logits(token, pos + i, cache)  # [vocab]
            if params.greedy:
                token = greedy_token(logits)
            else:
                q = sampling_probs(logits, params)  # [vocab]
                token = sample_from(q, generator)
                rows.append(q)
            tokens.append(token)
        return Draft(tokens, torch.stack(rows) if rows else None)

    def draft_logits(self, token: int, pos: int, cache) -> torch.Tensor:
        """The draft step's logits [vocab] for ``token`` at ``pos``, writing its KV into ``cache``."""
        return self.step(token, pos, cache)
