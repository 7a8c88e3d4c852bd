"""Prompt-lookup (n-gram) drafter: continue the latest earlier occurrence of the text's suffix.

The drafted tokens are the ones that followed the most recent earlier occurrence of the last n
tokens (n from ``max_ngram`` down to ``min_ngram``) in prompt + generated text. No weights are
read; the draft is deterministic (its distribution q is one-hot), so speculative sampling accepts
token d with probability p(d).

Example::

    drafter = LookupDrafter()
    drafter.draft([5, 6, 7, 8, 5, 6], k=3)   # -> [7, 8, 5]: "5 6" was followed by "7 8 5"
"""
from __future__ import annotations

DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1


class LookupDrafter:
    """Incremental index: for each n, n-gram -> the end index of its latest occurrence that has a
    following token. ``draft`` indexes whatever text was appended since the last call."""

    deterministic = True

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed_ends = 0  # n-grams ending at indices < this are indexed
        self._history_len = 0

    def _extend(self, history: list[int]) -> None:
        if len(history) < self._history_len:
            raise ValueError("the history may only grow (use a fresh LookupDrafter per sequence)")
        self._history_len = len(history)
        last_end = len(history) - 1  # an n-gram ending here has no continuation yet
        for end in range(self._indexed_ends, last_end):
            for n, table in self._index.items():
                if end - n + 1 >= 0:
                    table[tuple(history[end - n + 1:end + 1])] = end
        self._indexed_ends = max(self._indexed_ends, last_end)

    def draft(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``history`` (may be fewer, or none without a match)."""
        if k < 1 or not history:
            return []
        self._extend(history)
        for n in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            end = self._index[n].get(tuple(history[-n:]))
            if end is not None:
                return list(history[end + 1:end + 1 + k])
        return []
