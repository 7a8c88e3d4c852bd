"""The one MoE dispatch/combine (tandem/core/ffn/dense.py) against a per-token brute-force loop."""
from __future__ import annotations

import torch

from tandem.core.ffn.dense import combine_experts, tokens_by_expert


def test_dispatch_and_combine_match_a_per_token_loop():
    torch.manual_seed(0)
    T, d, E, k = 9, 6, 5, 2
    x = torch.randn(T, d)  # [T, d]
    expert_ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])  # [T, k]
    weights = torch.rand(T, k)  # [T, k]
    scale = torch.randn(E, d)  # expert e: y = x * scale[e]
    routed = tokens_by_expert(expert_ids)
    assert list(routed) == sorted(set(expert_ids.flatten().tolist()))
    for e, (token_idx, rank) in routed.items():
        assert (expert_ids[token_idx, rank] == e).all()
    assert sum(len(t) for t, _ in routed.values()) == T * k  # every (token, slot) exactly once
    results = {e: x[token_idx] * scale[e] for e, (token_idx, _) in routed.items()}
    want = torch.zeros(T, d)
    for t in range(T):
        for slot in range(k):
            want[t] += weights[t, slot] * x[t] * scale[expert_ids[t, slot]]
    torch.testing.assert_close(combine_experts(x, routed, results, weights), want)
