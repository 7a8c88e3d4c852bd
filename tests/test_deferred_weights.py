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
from tandem.core import loading
from tandem.core.errors import TandemError
from tandem.core.loading import gguf_loader, load_checkpoint
from tandem.core.loading import deferred
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
    monkeypatch.setenv(DEFER_ENV, "0")
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
    monkeypatch.setattr(deferred, "available_memory_bytes", lambda: 8 << 30)
    assert defer_wanted(7 << 30) and not defer_wanted(5 << 30)  # over 3/4 of what is available
    monkeypatch.setattr(deferred, "available_memory_bytes", lambda: None)
    assert not defer_wanted(1 << 60)  # unknown: load as before
    monkeypatch.setenv(DEFER_ENV, "yes")
    with pytest.raises(TandemError, match="TANDEM_DEFER_WEIGHTS must be 1"):
        defer_wanted(1)


def _packed_step_arrays(ckpt, args: EngineArgs):
    net, ffn_layers = build_model(ckpt)
    built = build_executor(args, ckpt, net, ffn_layers)
    _, arrays = describe_step(FusedDecodeStep.build(net, built.executor))
    return arrays


class DecodeLedger:
    """Counts decodes, and decoded float32 storages alive at once: each decode's numpy buffer is watched, and
    torch.from_numpy's tensor (and every view or alias of it) keeps that buffer alive."""

    def __init__(self, monkeypatch) -> None:
        self.decodes = self.live = self.peak = 0
        real = gguf_loader.decode_float32

        def decode(data, qtype, shape):
            buf = np.empty(shape, np.float32)  # watched: the tensor handed out owns it
            buf[...] = real(data, qtype, shape).numpy()
            self.decodes += 1
            self.live += 1
            self.peak = max(self.peak, self.live)
            weakref.finalize(buf, self._freed)
            return torch.from_numpy(buf)
        monkeypatch.setattr(gguf_loader, "decode_float32", decode)  # what load_gguf binds into each DeferredTensor

    def _freed(self) -> None:
        self.live -= 1


def test_threaded_decode_equals_one_pass(smollm2_path, monkeypatch):
    from tandem.core.loading.quants import dequantize
    monkeypatch.setattr(gguf_loader, "DECODE_SPLIT_ELEMENTS", 1 << 12)
    monkeypatch.setattr(gguf_loader, "_decode_workers", lambda: 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        raw = load_checkpoint(smollm2_path, deferred=True).raw
        for name in ("model.layers.2.mlp.down_proj.weight", "model.embed_tokens.weight",
                     "model.layers.0.self_attn.k_proj.weight"):
            r = raw[name]
            assert torch.equal(gguf_loader.decode_float32(r.data, r.qtype, r.shape),
                               torch.from_numpy(dequantize(r.data, r.qtype, r.shape))), name
    finally:
        torch.set_num_threads(threads)


def test_ledger_sees_a_held_alias(smollm2_path, monkeypatch):
    ledger = DecodeLedger(monkeypatch)
    ckpt = load_checkpoint(smollm2_path, deferred=True)
    held = [ckpt.tensors[f"model.layers.{i}.mlp.up_proj.weight"].float().numpy() for i in range(3)]
    assert (ledger.decodes, ledger.peak, ledger.live) == (3, 3, 3)
    del held
    assert ledger.live == 0


@pytest.mark.parametrize("weight_format", ["int4", "int8"])
def test_packed_build_from_deferred_weights_is_byte_identical(smollm2_path, weight_format, monkeypatch):
    """int4 reads the Q4_1 blocks as they are (nothing decoded); int8 re-quantizes from the decoded floats, one
    matrix at a time."""
    args = EngineArgs.create(str(smollm2_path), weight_format=weight_format, threads=1)
    eager = _packed_step_arrays(load_checkpoint(smollm2_path), args)
    ledger = DecodeLedger(monkeypatch)
    lazy = _packed_step_arrays(load_checkpoint(smollm2_path, deferred=True), args)
    assert eager.keys() == lazy.keys()
    for key in eager:
        assert np.array_equal(eager[key], lazy[key]), key
    if weight_format == "int8":
        assert ledger.decodes >= 7 * 30  # every layer matrix, re-quantized from float
    assert ledger.peak <= 2  # decoded matrices alive at once while packing: the point of deferring


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory, smollm2_path):
    from synth import SynthSpec, get_shape, synthesize
    out = tmp_path_factory.mktemp("deferred")
    return {name: synthesize(SynthSpec(get_shape(name), sparsity=0.9, sample_seqs=4), out / name,
                             str(smollm2_path)).path for name in ("tiny", "tiny-moe")}


def _engine(path, monkeypatch, defer: str, **kw):
    """An engine on deferred weights ("1"), or on eagerly decoded ones ("0"; packed engines defer whatever the
    environment says, so the eager reference forces the loader)."""
    from online import Engine
    monkeypatch.setenv(DEFER_ENV, defer)
    real = loading.load_checkpoint
    with monkeypatch.context() as m:
        if defer == "0":
            m.setattr(loading, "load_checkpoint", lambda model, deferred=False: real(model, deferred=False))
        engine = Engine.load(path, threads=1, step_cache=False, **kw)
    if defer == "0":
        assert not any(isinstance(p, DeferredTensor) for p in engine.model.parameters())
    return engine


@pytest.mark.parametrize("shape,kw", [
    ("tiny", {}), ("tiny", {"weight_format": "fp32"}), ("tiny", {"weight_format": "int8"}),
    ("tiny-moe", {}), ("tiny-moe", {"weight_format": "int8"}),
    ("tiny-moe", {"expert_slots": 2, "gpu_device": "cpu"}),
])
def test_engines_on_deferred_weights_match_eager_and_decode_nothing_per_token(tiny_ggufs, monkeypatch, shape, kw):
    """Untied output layer (synth's), MoE routers / experts / fp32 runtimes: the same logits, and once built a
    packed engine decodes nothing per token (what it still uses in float32 was pinned)."""
    ids = [5, 17, 99, 3, 250, 41]
    eager = _engine(tiny_ggufs[shape], monkeypatch, "0", **kw)
    ledger = DecodeLedger(monkeypatch)
    lazy = _engine(tiny_ggufs[shape], monkeypatch, "1", **kw)
    assert torch.equal(lazy.logits(ids), eager.logits(ids))
    assert ledger.decodes > 0  # dense: on use; packed: to pack the Q4_0 file as int8 / fp32 (nothing is in place)
    before = ledger.decodes
    lazy.generate(ids, max_new_tokens=4)
    assert lazy.logits(ids).shape[0] == len(ids)
    if kw:  # packed: float leftovers pinned (a dense engine decodes on every use by design)
        assert ledger.decodes == before


def test_dense_engine_says_when_it_decodes_on_use(smollm2_path, monkeypatch, capsys):
    from online import Engine
    monkeypatch.setenv(DEFER_ENV, "1")
    Engine.load(smollm2_path)
    assert "decodes each matrix when it uses it" in capsys.readouterr().err
    Engine.load(smollm2_path, weight_format="int4", step_cache=False)  # packed: deferred, nothing to say
    assert "decodes each matrix" not in capsys.readouterr().err
