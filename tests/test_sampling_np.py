"""numpy sampling (the torch-free generate path) against tandem.core.sampling's torch reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.core.sampling import SamplingParams, sample_next, sampling_probs
from tandem.core.sampling_np import make_rng, sample_next_np, sampling_probs_np


def test_greedy_is_torch_argmax_ties_included():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randint(-3, 3, (97,), generator=g).float()  # many ties
        assert sample_next_np(logits.numpy(), SamplingParams(), make_rng(SamplingParams())) == \
            sample_next(logits, SamplingParams(), g)


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_p=0.8),
                                dict(temperature=1.0, top_k=20, top_p=0.5), dict(temperature=0.5, top_p=1e-6)])
def test_distribution_equals_torch(kw):
    params = SamplingParams(**kw)
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2)) * 3
    want = sampling_probs(logits, params).double().numpy()
    got = sampling_probs_np(logits.numpy(), params)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert ((got > 0) == (want > 0)).all()


def test_draws_follow_the_distribution_and_the_seed():
    params = SamplingParams(temperature=1.0, top_k=4, seed=11)
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0], dtype=np.float32)
    probs = sampling_probs_np(logits, params)
    rng = make_rng(params)
    draws = np.array([sample_next_np(logits, params, rng) for _ in range(4000)])
    assert set(draws.tolist()) <= set(np.flatnonzero(probs).tolist())
    freq = np.bincount(draws, minlength=len(probs)) / len(draws)
    assert np.abs(freq - probs).max() < 0.03
    again = make_rng(params)
    assert [sample_next_np(logits, params, again) for _ in range(20)] == draws[:20].tolist()


@pytest.mark.parametrize("kw", [dict(temperature=1e-300), dict(temperature=5e-324), dict(temperature=1e-31),
                                dict(temperature=2e-30), dict(temperature=1e-6),  # the smallest sampled ones
                                dict(temperature=1.0, top_p=1e-300), dict(temperature=0.7, top_p=5e-324)])
def test_vanishing_temperature_or_top_p_samples_the_argmax(kw):
    """The limits of temperature -> 0 and top_p -> 0 are the argmax (np.argmax the reference): a value under
    float32's range once divided the logits into inf / nan (torch.multinomial then raised, failing a request)."""
    params = SamplingParams(seed=3, **kw)
    logits = torch.randn(300, generator=torch.Generator().manual_seed(5)) * 3
    best = int(np.argmax(logits.numpy()))
    for probs in (sampling_probs(logits, params).double().numpy(), sampling_probs_np(logits.numpy(), params)):
        assert probs[best] == 1.0 and probs.sum() == 1.0
    assert sample_next(logits, params, torch.Generator().manual_seed(3)) == best
    assert sample_next_np(logits.numpy(), params, make_rng(params)) == best


def test_a_seed_gives_the_same_text_on_every_decode_path(tmp_path):
    """Plain requests on the cached C step sample in numpy (step_loop), logprobs and module-path requests in
    torch: the same seed gave other text on each (a user adding --logprobs saw another story). Both now draw from
    numpy's generator over the same logits: the same tokens on the torch-free path, with logprobs, on the module
    graph's step and through the server's scheduler (references: each other, and greedy where temperature is 0)."""
    import asyncio

    from helpers_tiny import build_tiny_chat_model
    from online import Engine
    from online.server.scheduler import Scheduler
    from online.server.metrics import Metrics
    folder = build_tiny_chat_model(tmp_path / "model")
    fast = Engine.load(str(folder), weight_format="int4")
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    plain = fast.generate("Once upon a time", **kw)
    assert fast.generate("Once upon a time", **kw, logprobs=True).token_ids == plain.token_ids
    modules = Engine.load(str(folder), weight_format="int4", step_cache=False)
    assert modules.generate("Once upon a time", **kw).token_ids == plain.token_ids
    assert fast.generate("Once upon a time", **{**kw, "seed": 8}).token_ids != plain.token_ids  # the seed matters

    async def served():
        sched = Scheduler(fast, max_queue=4, request_timeout_s=60.0, metrics=Metrics())
        sched.start()
        ids = fast.encode_prompt("Once upon a time")
        job = sched.submit(ids, 24, {"temperature": 0.9, "top_p": 0.95, "seed": 7, "top_k": 0, "stop": None,
                                     "ignore_eos": True}, stream_pieces=False, loop=asyncio.get_running_loop())
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "done":
                    return value
        finally:
            await asyncio.get_running_loop().run_in_executor(None, sched.close)
    assert asyncio.run(served()).token_ids == plain.token_ids
