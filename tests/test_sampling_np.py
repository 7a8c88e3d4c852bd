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
