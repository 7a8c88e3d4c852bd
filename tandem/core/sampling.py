"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p, logprobs, constraints)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tandem.core.errors import TandemError


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
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise bad(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits [vocab] -> token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = sampling_probs(logits, params)  # [vocab]
    return int(torch.multinomial(probs, 1, generator=generator))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample_next`` draws from (temperature, top-k, top-p applied): [vocab] float32.
    Greedy (temperature 0) is the one-hot of the argmax. Speculative sampling applies it to the
    verifier's and the drafter's logits alike.

    Example::

        p = sampling_probs(logits, SamplingParams(temperature=0.8, top_p=0.9))   # sums to 1
    """
    if params.greedy:
        return torch.nn.functional.one_hot(torch.argmax(logits), logits.shape[-1]).float()
    scores = logits.float() / params.temperature  # [vocab]
    if params.top_k and params.top_k < scores.shape[0]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_scores, dim=-1) >= params.top_p  # keep the first token always
        scores = scores.scatter(0, order[drop], float("-inf"))
    return torch.softmax(scores, dim=-1)


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


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                 options: DecodeOptions | None = None, state: Any = None) -> TokenChoice:
    """logits [vocab] -> the next token, through the constraint ``state`` when there is one.

    Log-probabilities are the log-softmax of the RAW logits: the model's own distribution, before
    temperature, top-k/top-p and the grammar mask (as vLLM's default ``raw_logprobs``; OpenAI does
    not say). The constraint masks disallowed tokens before sampling, greedy included; once the
    grammar is complete only end-of-sequence is allowed. ``state`` is advanced by the chosen token.
    """
    scores = logits
    if state is not None:
        allowed = state.allowed(logits.shape[-1])  # [vocab] bool
        scores = logits.float().masked_fill(~allowed, float("-inf"))  # [vocab]
    token = sample_next(scores, params, generator)
    if state is not None:
        state.advance(token)
    if options is None or not options.logprobs:
        return TokenChoice(token)
    logp = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    top: tuple[tuple[int, float], ...] = ()
    if options.top_logprobs:
        values, ids = torch.topk(logp, min(options.top_logprobs, logp.shape[-1]))  # [k], [k]
        top = tuple((int(i), float(v)) for i, v in zip(ids, values))
    return TokenChoice(token, float(logp[token]), top)
