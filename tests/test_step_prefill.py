"""Generation's prefill through the fused step's batched call equals the prompt fed token by token through
the single-token decode step (logits, greedy tokens, KV and neuron counts)."""
from __future__ import annotations

import torch

from online import Engine
from tandem.core.sampling import SamplingParams, choose_token

PROMPT = [1, 7, 42, 3, 99, 12, 5, 64, 8, 21, 33]


def greedy_by_single_steps(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The reference: every prompt token through the one-token step, then greedy decoding; (tokens, KV keys)."""
    cache = engine._kv_cache(len(prompt) + n)
    for pos, token in enumerate(prompt):
        logits = engine.compiled_decode(token, pos, cache)
    out, params = [], SamplingParams(max_new_tokens=n)
    for pos in range(len(prompt), len(prompt) + n):
        out.append(choose_token(logits, params, None).token_id)
        logits = engine.compiled_decode(out[-1], pos, cache)
    return out, cache.keys[:, :, :len(prompt)].clone()


def test_generate_prefills_through_the_fused_step_bit_identically(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    engine = Engine.load(folder, weight_format="int8", threads=1)
    assert engine.decode_path == "fused"
    ref_tokens, ref_keys = greedy_by_single_steps(engine, PROMPT, 6)
    def no_module_graph(*args, **kwargs):
        raise AssertionError("generate ran the module graph on the fused path")
    engine.model.forward = no_module_graph  # the prompt must go through the fused step alone
    out = engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert out.token_ids == ref_tokens
    cache = engine._kv_cache(len(PROMPT) + 1)
    last = engine.compiled_decode.prefill_logits(PROMPT, 0, cache)
    assert torch.equal(cache.keys[:, :, :len(PROMPT)], ref_keys)
    single = engine._kv_cache(len(PROMPT) + 1)
    for pos, token in enumerate(PROMPT):
        expected = engine.compiled_decode(token, pos, single)
    assert torch.equal(last, expected)
