"""The Engine's scoring methods: logits of a prompt (batched prefill), logits through the decode
path generation uses (the fused step, one or several tokens per call) and sliding-window perplexity.
They run on the module graph (an engine loaded from its step cache builds it on first use).

Example::

    logits = engine.logits([1, 2, 3])                 # [3, vocab] float32 torch.Tensor
    ppl, scored = engine.perplexity(ids, window_tokens=512, stride_tokens=256)
"""
from __future__ import annotations

import operator
from typing import Any

from tandem.core.errors import TandemError, check_int

from .results import sliding_window_perplexity


class Scoring:
    """Mixed into online.engine.Engine."""

    def logits(self, token_ids: list[int]):
        """float32 logits [T, vocab] (torch.Tensor) for a 1-D list of token ids (a fresh context)."""
        from tandem.core.generate import prefill
        ids = self.encode_prompt(token_id_list(token_ids))
        cache = self._kv_cache(len(ids))
        return prefill(self.model, self.executor, cache, ids, all_logits=True).float()

    def step_logits(self, token_ids: list[int], tokens_per_step: int = 1):
        """Logits [T, vocab] computed one token at a time through the decode path generation uses
        (the fused C step where it applies): what sampling sees, unlike ``logits`` (batched prefill).
        ``tokens_per_step`` > 1: that many tokens per multi-token step (``step_many``, the speculative
        verify step: bit-identical to single steps; needs the fused step)."""
        ids = token_id_list(token_ids)  # (as logits and perplexity: int("a") was a ValueError, True a token)
        if not ids:
            raise TandemError("no tokens to score")
        if len(ids) > self.max_context:
            raise TandemError(f"{len(ids)} tokens exceed the context length ({self.max_context})")
        import torch
        from tandem.core.generate import decode_one_token
        cache = self._kv_cache(len(ids))
        threads = torch.get_num_threads()
        if self.decode_threads is not None:
            torch.set_num_threads(self.decode_threads)
        try:
            if tokens_per_step > 1:
                from .speculative.setup import verifier_step
                step = verifier_step(self)
                with torch.inference_mode():
                    return torch.cat([step.step_many(ids[i:i + tokens_per_step], i, cache)
                                      for i in range(0, len(ids), tokens_per_step)]).float()
            rows = [decode_one_token(self.model, self.executor, cache, t, pos, self.compiled_decode)
                    for pos, t in enumerate(ids)]
        finally:
            torch.set_num_threads(threads)
        return torch.stack(rows).float()

    def perplexity(self, token_ids: list[int], window_tokens: int = 512, stride_tokens: int = 256,
                   decode_steps: bool = False, tokens_per_step: int = 1) -> tuple[float, int]:
        """Sliding-window perplexity; returns (perplexity, number of scored tokens). ``decode_steps``
        scores one token at a time through the decode path (``step_logits``: what generation
        computes, the fused step included) instead of batched prefill; ``tokens_per_step`` > 1
        scores the known text that many tokens per multi-token step (same numbers, fewer weight reads)."""
        for name, value, least in (("window_tokens", window_tokens, 2), ("stride_tokens", stride_tokens, 1),
                                   ("tokens_per_step", tokens_per_step, 1)):
            check_int(name, value, least, optional=False)
        if stride_tokens > window_tokens:
            raise TandemError(f"stride_tokens ({stride_tokens}) must not exceed window_tokens ({window_tokens}): "
                              "the first token of each window would go unscored")
        return sliding_window_perplexity(
            token_id_list(token_ids), window_tokens=min(window_tokens, self.max_context - 1),
            stride_tokens=stride_tokens,
            window_logits=lambda window: (self.step_logits(window, tokens_per_step)
                                          if decode_steps or tokens_per_step > 1 else self.logits(window)))


def token_id_list(token_ids: Any) -> list[int]:
    """A list of Python ints from a list, tuple, numpy array or 1-D tensor of integer token ids."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise TandemError(f"token ids must be a list of integers (encode text with engine.encode_prompt), "
                          f"got {type(token_ids).__name__}")
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError:
        raise TandemError("token ids must be integers") from None
    if any(isinstance(t, bool) for t in token_ids):
        raise TandemError("token ids must be integers, not booleans")
    return ids
