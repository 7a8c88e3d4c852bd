"""Sampling settings and the chosen token, without torch (tandem.core.sampling re-exports them; the
torch-free generate path (tandem.core.sampling_np) and the CLI's argument check import only this).

Example::

    params = SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, seed=1)
    TokenChoice(17)   # the chosen token (logprob and alternatives when asked for)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tandem.core.errors import TandemError


# Logits of |l| <= 1e8 over a temperature of at least this stay finite in float32 (max 3.4e38)
GREEDY_BELOW_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class SamplingParams:
    """Validated decoding settings. temperature 0 means greedy.

    Example::

        params = SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, seed=1)
    """
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def bad(msg: str) -> TandemError:
            return TandemError(f"invalid sampling value: {msg}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise bad(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that logits / temperature leave float32's range (it samples as its
        limit, the argmax)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class DecodeOptions:
    """Per-request extras of the token choice: log-probabilities and a grammar constraint.

    ``constraint``: a factory called once per sequence that returns its constraint state (an object
    with ``allowed(vocab_size) -> BoolTensor [vocab]``, ``advance(token_id)`` and ``ends(token_id)``: the
    advanced token closed the sequence); see online.constrain.grammar.GrammarConstraint.

    Example::

        options = DecodeOptions(logprobs=True, top_logprobs=3)
        choice = choose_token(logits, SamplingParams(), make_generator(SamplingParams()), options)
        choice.token_id, choice.logprob, choice.top_logprobs  # 17, -0.21, ((17, -0.21), (4, -2.3), (9, -3.0))
    """
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Any = None  # () -> constraint state, or None

    def __post_init__(self) -> None:
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise TandemError(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise TandemError("top_logprobs needs logprobs")
        if self.constraint is not None and not callable(self.constraint):
            raise TandemError("the decode constraint must be a factory (a callable returning a state)")

    def new_state(self) -> Any:
        """A fresh constraint state for one sequence (None without a constraint)."""
        return None if self.constraint is None else self.constraint()


@dataclass(frozen=True)
class TokenChoice:
    """The chosen token; with logprobs, its log-probability and the most likely alternatives."""
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
