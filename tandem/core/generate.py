"""The generation loop as small functions: ``prefill`` and ``decode_one_token``."""
from __future__ import annotations

import time
from typing import Iterator

import torch

from .kv_cache import KVCache
from .sampling import DecodeOptions, SamplingParams, choose_token, make_generator
from .step_loop import LoopTimings, TokenEvent

__all__ = ["LoopTimings", "TokenEvent", "decode_one_token", "prefill", "token_loop"]

PREFILL_CHUNK_TOKENS = 512  # tokens per module-graph forward of a prefill without the fused step


@torch.inference_mode()
def prefill(model, executor, cache: KVCache, token_ids: list[int], start_pos: int = 0,
            all_logits: bool = False, compiled=None) -> torch.Tensor:
    """Run the prompt through the model in chunks; logits of the last position [vocab] (or all [T, vocab]).

    ``compiled``: the fused C step, which prefills the whole prompt (in calls of at most 64 tokens; every
    KV row and the logits equal the single-token step's, as the torch-free cached engine's prefill),
    unless all logits are asked for: then the module graph. So a prompt gives the same KV cache on
    every path that decodes through the step (plain, speculative, served).
    """
    if compiled is not None and not all_logits and compiled.prefills_natively:
        return compiled.prefill_logits(token_ids, start_pos, cache)
    outputs = []
    for begin in range(0, len(token_ids), PREFILL_CHUNK_TOKENS):
        chunk = torch.tensor(token_ids[begin: begin + PREFILL_CHUNK_TOKENS], dtype=torch.long)
        outputs.append(model(chunk, start_pos + begin, cache, executor, all_logits=all_logits))
    return torch.cat(outputs) if all_logits else outputs[-1][-1]


@torch.inference_mode()
def decode_one_token(model, executor, cache: KVCache, token_id: int, pos: int, compiled=None) -> torch.Tensor:
    """One decode step at position ``pos``: logits [vocab]. ``compiled``: a whole-step kernel
    (online.execution.fused_decode.FusedDecodeStep) run instead of the module graph."""
    if compiled is not None:
        return compiled(token_id, pos, cache)
    return model(torch.tensor([token_id], dtype=torch.long), pos, cache, executor)[-1]


def token_loop(model, executor, cache: KVCache, prompt_ids: list[int], params: SamplingParams,
               eos_ids: set[int], max_total_tokens: int, timings: LoopTimings,
               decode_threads: int | None = None, compiled=None,
               options: DecodeOptions | None = None) -> Iterator[TokenEvent]:
    """Yield sampled tokens one by one until EOS, max_new_tokens or the context is full.

    ``options``: logprobs and a grammar constraint (``choose_token``); a sequence whose grammar is
    complete stops as at EOS.

    ``decode_threads``: torch's thread count while decoding (1 when the C kernels do the parallel
    work: two OpenMP pools alternating on few cores stall each other); prefill keeps the default.

    ``compiled``: the fused step, which also prefills short prompts (``prefill``).
    """
    prefill_threads = torch.get_num_threads()
    try:
        yield from _token_loop(model, executor, cache, prompt_ids, params, eos_ids, max_total_tokens, timings,
                               decode_threads, compiled, options)
    finally:
        torch.set_num_threads(prefill_threads)


def _token_loop(model, executor, cache, prompt_ids, params, eos_ids, max_total_tokens, timings, decode_threads,
                compiled, options):
    generator = make_generator(params)
    state = options.new_state() if options is not None else None
    timings.start_s = time.perf_counter()
    logits = prefill(model, executor, cache, prompt_ids, compiled=compiled)
    if decode_threads is not None:
        torch.set_num_threads(decode_threads)
    pos = len(prompt_ids)
    budget = min(params.max_new_tokens, max_total_tokens - pos)
    for step in range(budget):
        choice = choose_token(logits, params, generator, options, state)
        token = choice.token_id
        if step == 0:
            timings.first_token_s = time.perf_counter()
        if token in eos_ids or (state is not None and state.ends(token)):
            timings.end_s = time.perf_counter()
            yield TokenEvent(token, "stop", choice)
            return
        last = step == budget - 1
        if last:
            timings.end_s = time.perf_counter()
        yield TokenEvent(token, "length" if last else None, choice)
        if last:
            return
        logits = decode_one_token(model, executor, cache, token, pos, compiled)
        timings.decode_steps += 1
        pos += 1
