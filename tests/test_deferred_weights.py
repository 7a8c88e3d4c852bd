"""Deferred weights (tandem/core/loading/deferred.py): a GGUF's layer matrices stay in their blocks until used.

References: the eager load (every tensor decoded at load), plain torch on the decoded tensor, and the packed
engine built from an eager checkpoint (its fused step's arrays, byte for byte).
"""
from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from online.engine_build import build_executor
from online.engine_args import EngineArgs
from online.execution.fused_decode import FusedDecodeStep
from online.execution.step_cache import describe_step
from predictors.pipeline import model_param_count
from tandem.core.loading import load_checkpoint
from tandem.core.loading.deferred import DEFER_ENV, DeferredTensor, defer_wanted
from tandem.core.model.build import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _counting(src: torch.Tensor):
    calls = []

    def load() -> torch.Tensor:
        calls.append(1)
        return src.clone()
    return DeferredTensor(tuple(src.shape), load), calls


def test_metadata_does_not_decode_and_ops_match_plain_torch():
    src = torch.randn(6, 4)
    w, calls = _counting(src)
    assert (tuple(w.shape), w.dtype, w.device.type, w.numel(), w.dim(), w.element_size(), w.is_meta) == \
        ((6, 4), torch.float32, "cpu", 24, 2, 4, False)
    assert calls == []
    x = torch.randn(3, 4)
    assert torch.equal(F.linear(x, w), F.linear(x, src))
    assert torch.equal(w[torch.tensor([1, 3])], src[torch.tensor([1, 3])])
    assert torch.equal(w.t().contiguous(), src.t().contiguous())
    assert np.array_equal(np.asarray(w), src.numpy())
    assert type(w + 1) is torch.Tensor and len(calls) >= 4


def test_decoded_tensor_is_reused_while_held_and_dropped_after():
    w, calls = _counting(torch.randn(5, 3))
    held = w.float()  # float32 already: the decoded tensor itself
    assert torch.equal(w * 2, held * 2) and len(calls) == 1  # reused: someone holds it
    ref = weakref.ref(held)
    del held
    assert ref() is None  # the deferred tensor keeps no strong reference
    _ = w.sum()
    assert len(calls) == 2


def test_stays_deferred_through_parameter_and_build_model(smollm2_path):
    ckpt = load_checkpoint(smollm2_path, deferred=True)
    q = ckpt.tensors["model.layers.3.self_attn.q_proj.weight"]
    assert isinstance(q, DeferredTensor)
    assert not isinstance(ckpt.tensors["model.embed_tokens.weight"], DeferredTensor)  # a lookup table stays decoded
    net, ffn_layers = build_model(ckpt)
    weight = net.layers[3].self_attn.q_proj.weight
    assert isinstance(weight, DeferredTensor) and isinstance(weight, torch.nn.Parameter)  # registered, still deferred
    assert not weight.requires_grad
    assert isinstance(ffn_layers[0].down, DeferredTensor)


def test_deferred_checkpoint_decodes_the_same_values(smollm2_path):
    eager = load_checkpoint(smollm2_path)
    lazy = load_checkpoint(smollm2_path, deferred=True)
    assert lazy.fingerprint == eager.fingerprint and lazy.tensors.keys() == eager.tensors.keys()
    n_deferred = 0
    for name, t in eager.tensors.items():
        d = lazy.tensors[name]
        n_deferred += isinstance(d, DeferredTensor)
        assert torch.equal(torch.as_tensor(np.asarray(d)), t), name
    assert n_deferred == 7 * eager.config.num_layers  # q, k, v, o, gate, up, down (the head is tied)
    assert lazy.deferred_bytes == 4 * sum(t.numel() for k, t in eager.tensors.items() if k.startswith("model.layers.")
                                          and t.dim() == 2)


def test_dense_engine_on_deferred_weights_matches_eager(smollm2_path, monkeypatch):
    from online import Engine
    ids = [1, 504, 3458, 28, 9]
    eager = Engine.load(smollm2_path)
    monkeypatch.setenv(DEFER_ENV, "1")
    deferred = Engine.load(smollm2_path)
    assert isinstance(deferred.model.layers[0].self_attn.q_proj.weight, DeferredTensor)
    assert torch.equal(deferred.logits(ids), eager.logits(ids))
    # counted by identity: each use of a deferred weight decodes it anew, often at a freed tensor's address
    assert model_param_count(deferred) == model_param_count(eager)


def test_defer_wanted_follows_the_environment_then_available_memory(monkeypatch):
    monkeypatch.setenv(DEFER_ENV, "1")
    assert defer_wanted(1)
    monkeypatch.setenv(DEFER_ENV, "0")
    assert not defer_wanted(1 << 60)
    monkeypatch.delenv(DEFER_ENV)
    assert defer_wanted(1 << 60) and not defer_wanted(1)


def _packed_step_arrays(ckpt, args: EngineArgs):
    net, ffn_layers = build_model(ckpt)
    built = build_executor(args, ckpt, net, ffn_layers)
    _, arrays = describe_step(FusedDecodeStep.build(net, built.executor))
    return arrays


@pytest.mark.parametrize("weight_format", ["int4", "int8"])
def test_packed_build_from_deferred_weights_is_byte_identical(smollm2_path, weight_format):
    """int4 reads the Q4_1 blocks as they are; int8 re-quantizes from the decoded floats, one matrix at a time."""
    args = EngineArgs.create(str(smollm2_path), weight_format=weight_format, threads=1)
    eager = _packed_step_arrays(load_checkpoint(smollm2_path), args)
    lazy_ckpt = load_checkpoint(smollm2_path, deferred=True)
    live, peak = [0], [0]
    for t in lazy_ckpt.tensors.values():
        if isinstance(t, DeferredTensor):
            t._load = _tracking(t._load, live, peak)
    lazy = _packed_step_arrays(lazy_ckpt, args)
    assert eager.keys() == lazy.keys()
    for key in eager:
        assert np.array_equal(eager[key], lazy[key]), key
    assert peak[0] <= 2  # matrices decoded at the same time while packing: the point of deferring


def _tracking(load, live: list[int], peak: list[int]):
    def wrapped() -> torch.Tensor:
        out = load()
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        weakref.finalize(out, _dec, live)
        return out
    return wrapped


def _dec(live: list[int]) -> None:
    live[0] -= 1


def test_dense_engine_says_when_it_decodes_on_use(smollm2_path, monkeypatch, capsys):
    from online import Engine
    monkeypatch.setenv(DEFER_ENV, "1")
    Engine.load(smollm2_path)
    assert "decodes each matrix when it uses it" in capsys.readouterr().err
    Engine.load(smollm2_path, weight_format="int4", step_cache=False)  # packed: deferred, nothing to say
    assert "decodes each matrix" not in capsys.readouterr().err
