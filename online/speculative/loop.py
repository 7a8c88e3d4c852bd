"""The speculative decode loop: draft k, verify k + 1 in one multi-token step, emit one by one.

Every emitted token goes through the same EOS / length checks as ``tandem.core.generate.token_loop``,
one at a time, so a stop inside an accepted run ends the sequence exactly where plain decoding
would. Rollback is free: after a rejection the pending position moves back behind the rejected
rows, which the next step overwrites before anything reads them (attention reads rows 0..pos).

Example::

    stats = SpecStats("lookup")
    for event in speculative_token_loop(model, executor, cache, prompt_ids, params, eos_ids, max_ctx,
                                        timings, step, {"lookup": LookupProposer()}, policy, stats):
        ...
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from tandem.core.generate import LoopTimings, TokenEvent, prefill
from tandem.core.sampling import SamplingParams, make_generator, sample_next
from .config import SpecStats
from .verify import accept_greedy, accept_sampled


def speculative_token_loop(model, executor, cache, prompt_ids: list[int], params: SamplingParams,
                           eos_ids: set[int], max_total_tokens: int, timings: LoopTimings, step,
                           drafters: dict, policy, stats: SpecStats,
                           decode_threads: int | None = None) -> Iterator[TokenEvent]:
    """Like ``token_loop`` (same events, same stopping, same prefill), decoding through ``step`` (a
    FusedDecodeStep: ``__call__`` and ``step_many``) with ``drafters`` (name -> proposer)."""
    prefill_threads = torch.get_num_threads()
    try:
        yield from _loop(model, executor, cache, prompt_ids, params, eos_ids, max_total_tokens, timings, step,
                         drafters, policy, stats, decode_threads)
    finally:
        torch.set_num_threads(prefill_threads)


def _loop(model, executor, cache, prompt_ids, params, eos_ids, max_total_tokens, timings, step, drafters,
          policy, stats, decode_threads):
    generator = make_generator(params)
    timings.start_s = time.perf_counter()
    logits = prefill(model, executor, cache, prompt_ids, compiled=step)
    if decode_threads is not None:
        torch.set_num_threads(decode_threads)
    budget = min(params.max_new_tokens, max_total_tokens - len(prompt_ids))
    if budget < 1:
        return
    history = list(prompt_ids)
    token = sample_next(logits, params, generator)
    timings.first_token_s = time.perf_counter()
    emitted = 0
    pending = [token]
    while True:
        for token in pending:  # EOS and the length limit, one token at a time
            emitted += 1
            timings.decode_steps = emitted - 1  # tokens that came from decode steps (as token_loop counts)
            history.append(token)
            if token in eos_ids:
                timings.end_s = time.perf_counter()
                yield TokenEvent(token, "stop")
                return
            last = emitted == budget
            if last:
                timings.end_s = time.perf_counter()
            yield TokenEvent(token, "length" if last else None)
            if last:
                return
        t0 = time.perf_counter()
        pending = _next_tokens(history, cache, params, generator, step, drafters, policy, stats,
                               budget - emitted)
        stats.decode_s += time.perf_counter() - t0


@torch.inference_mode()
def _next_tokens(history, cache, params, generator, step, drafters, policy, stats, remaining: int) -> list[int]:
    """One verify step (or a plain step): 1..k+1 new tokens. ``history[-1]`` is pending at ``pos``."""
    pos = len(history) - 1
    max_draft = min(remaining - 1, policy.max_draft_tokens)  # never verify past what may be emitted
    available = {name: d.available(history, max_draft) for name, d in drafters.items()} if max_draft > 0 else {}
    name, k = policy.choose(max_draft, available)
    if name is not None:
        t0 = time.perf_counter()
        draft = drafters[name].propose(history, pos, cache, k, params, generator)
        t1 = time.perf_counter()
        stats.draft_s += t1 - t0
        if draft.tokens:
            logits = step.step_many([history[-1]] + draft.tokens, pos, cache)  # [k+1, vocab]
            out = (accept_greedy(draft.tokens, logits) if params.greedy
                   else accept_sampled(draft.tokens, draft.probs, logits, params, generator))
            verify_s = time.perf_counter() - t1
            accepted = len(out) - 1
            policy.record_verify(name, len(draft.tokens), accepted, len(draft.tokens) + 1, verify_s, t1 - t0)
            stats.verify_steps += 1
            stats.drafted += len(draft.tokens)
            stats.accepted += accepted
            stats.verify_tokens += len(out)
            return out
    t0 = time.perf_counter()
    logits = step(history[-1], pos, cache)  # [vocab]
    policy.record_plain(time.perf_counter() - t0)
    stats.plain_steps += 1
    return [sample_next(logits, params, generator)]
