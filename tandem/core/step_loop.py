"""The token loop over a whole-model step alone, without torch: what a plain request runs when the
engine was loaded from its prepared-step cache (online/engine_cache.py). tandem.core.generate's
loop over the module graph shares its events and timings (defined here, re-exported there).

``step``: anything with ``prefill_logits(ids, start_pos, cache) -> [vocab]`` (every KV row written)
and ``step(token_id, pos, cache) -> [vocab]`` (numpy logits): online.execution.native_step.NativeStep.

Example::

    timings = LoopTimings()
    for event in step_token_loop(step, cache, prompt_ids, SamplingParams(max_new_tokens=8), {2}, 2048, timings):
        print(event.token_id, event.finish_reason)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from .sampling_np import make_rng, sample_next_np
from .sampling_params import SamplingParams, TokenChoice


@dataclass
class TokenEvent:
    token_id: int
    finish_reason: str | None  # None while running; "stop" (EOS) | "length"
    choice: TokenChoice | None = None  # with its logprobs when DecodeOptions asked for them


@dataclass
class LoopTimings:
    start_s: float = 0.0
    first_token_s: float = 0.0
    end_s: float = 0.0
    decode_steps: int = 0


def step_token_loop(step, cache, prompt_ids: list[int], params: SamplingParams, eos_ids: set[int],
                    max_total_tokens: int, timings: LoopTimings) -> Iterator[TokenEvent]:
    """Sampled tokens one by one until EOS, max_new_tokens or the context is full (as token_loop)."""
    rng = make_rng(params)
    timings.start_s = time.perf_counter()
    logits = step.prefill_logits(prompt_ids, 0, cache)  # [vocab]
    pos = len(prompt_ids)
    budget = min(params.max_new_tokens, max_total_tokens - pos)
    for i in range(budget):
        token = sample_next_np(logits, params, rng)
        if i == 0:
            timings.first_token_s = time.perf_counter()
        if token in eos_ids:
            timings.end_s = time.perf_counter()
            yield TokenEvent(token, "stop", TokenChoice(token))
            return
        last = i == budget - 1
        if last:
            timings.end_s = time.perf_counter()
        yield TokenEvent(token, "length" if last else None, TokenChoice(token))
        if last:
            return
        logits = step(token, pos, cache)
        timings.decode_steps += 1
        pos += 1
