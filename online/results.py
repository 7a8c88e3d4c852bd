"""What generation and scoring hand back: GenerationResult, the TextStream of pieces, and the
sliding-window perplexity loop behind ``Engine.perplexity``.

Example::

    out = engine.generate("Hi", max_new_tokens=8)        # GenerationResult
    out.text, out.token_ids, out.finish_reason, out.stats["decode_tokens_per_s"]
    ppl, scored = sliding_window_perplexity(ids, 512, 256, engine.logits)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from tandem.core.errors import TandemError
from tandem.core.sampling_params import TokenChoice


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids (prompt excluded)
    prompt_tokens: int
    finish_reason: str  # "stop" | "length"
    stats: dict[str, Any] = field(default_factory=dict)
    choices: list[TokenChoice] = field(default_factory=list)  # one per generated token (logprobs when asked)


class TextStream:
    """Iterator of text pieces; ``.result`` holds the GenerationResult once exhausted; ``close()`` stops early.
    ``choices`` grows with each generated token (TokenChoice, with logprobs when asked for)."""

    def __init__(self, pieces: Iterator[str], holder: dict) -> None:
        self._pieces = pieces
        self._holder = holder

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    @property
    def result(self) -> GenerationResult | None:
        return self._holder.get("result")

    @property
    def choices(self) -> list[TokenChoice]:
        return self._holder.setdefault("choices", [])

    def close(self) -> None:
        self._pieces.close()


def sliding_window_perplexity(token_ids: list[int], window_tokens: int, stride_tokens: int,
                              window_logits: Callable[[list[int]], "torch.Tensor"]) -> tuple[float, int]:
    """(perplexity, scored tokens) over windows of ``window_tokens`` started every ``stride_tokens``;
    ``window_logits(window)`` -> [W, vocab]. Each token is scored once, with the longest context its window gives."""
    if len(token_ids) < 2:
        raise TandemError("need at least 2 tokens to compute perplexity")
    import torch
    import torch.nn.functional as F
    stride_tokens = min(stride_tokens, window_tokens)
    nll, scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(token_ids), stride_tokens):
        end = min(begin + window_tokens, len(token_ids))
        window = token_ids[begin:end]
        n_new = end - max(prev_end, begin + 1)
        if n_new <= 0:  # a last window of one token: no position in it has a target
            break
        logits = window_logits(window)  # [W, vocab]
        targets = torch.tensor(window[-n_new:])
        logp = F.log_softmax(logits[-n_new - 1:-1].double(), dim=-1)
        nll -= float(logp.gather(1, targets[:, None]).sum())
        scored += n_new
        prev_end = end
        if end == len(token_ids):
            break
    return math.exp(nll / scored), scored
