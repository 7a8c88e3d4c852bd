"""The CPU's share of a GPU step through the fused C step (decode.c ``tdm_decode_parts``) instead of the
modules: runs of whole CPU layers in one call, a layer's attention alone where its FFN rows are all on
the tier, a layer's cold FFN rows alone while the tier computes its hot rows, the host's output layer and
embedding row. Each is one C call on the residual stream (host), however many layers it holds.

Example::

    c = CpuLayers.build(model, executor)        # None where the C step does not apply
    c.whole(3), c.attention(3), c.ffn(3)        # which parts of layer 3 the C step runs
    c.run(3, 6, pos, cache, residual, parts=3)  # residual [d] float32 (host), in place
    c.run(6, 30, pos, cache, residual, logits=out)  # ... then the output layer: out [vocab] (c.has_head)
    c.embed(token_id, pos, residual)            # the host's embedding row (c.has_embed)
"""
from __future__ import annotations

import ctypes
from dataclasses import replace
from types import SimpleNamespace

import torch

from tandem.core.errors import TandemError

ATTENTION, FFN, BOTH = 1, 2, 3


def _on_tier(obj) -> bool:
    return bool(getattr(obj, "on_tier", False))


class CpuLayers:
    """The fused C step's descriptor for the layers with a CPU part (the others blank: never run)."""

    def __init__(self, step, attention: set, ffn: set, hot: set, head: bool = False, embed_rows: int = 0) -> None:
        self.step, self._attention, self._ffn, self._hot = step, attention, ffn, hot
        self.has_head = head  # the descriptor holds the host's output layer (C computes the logits)
        self.embed_rows = embed_rows  # ... and the host's embedding table of that many rows (0: none)

    @property
    def has_embed(self) -> bool:
        return self.embed_rows > 0

    def attention(self, layer: int) -> bool:
        return layer in self._attention

    def ffn(self, layer: int) -> bool:
        """The layer's cold rows (no hot rows, or no predictor to map onto the cold part) run in C."""
        return layer in self._ffn

    def whole(self, layer: int) -> bool:
        return layer in self._attention and layer in self._ffn and layer not in self._hot

    @classmethod
    def build(cls, model, executor, first: int = 0, last: int | None = None) -> "CpuLayers | None":
        from ..execution.fused_decode import FusedDecodeStep, FusedDecodeUnavailable
        from ..kernels.ffn import QuantizedLinear
        from ..kernels.native import NativeUnavailable, load_native
        from ..kernels.native.structs import TdmLayer
        last = model.cfg.num_layers if last is None else last
        cfg = model.cfg
        if not executor.packed or cfg.num_heads % cfg.num_kv_heads:  # as fused_decode._check_model
            return None
        attention, ffn, hot, described, splits = set(), set(), set(), [], []
        for i in range(first, last):
            block, split = model.layers[i], executor.splits[i]
            if split is None:
                return None
            attn = block.self_attn
            if not _on_tier(attn) and attn.qkv_proj is not None and hasattr(attn.o_proj, "linear"):  # packed
                attention.add(i)
            if split.gpu is not None:
                hot.add(i)
            if _c_reads_cold_rows(split):
                ffn.add(i)
            if i in attention or i in ffn:
                described.append(i)
                gate = _host_gate(split.predictor)
                if i not in ffn:
                    split = replace(split, cpu=None, predictor=None)
                elif split.gpu is not None and gate is not None:  # score the cold rows only
                    split = replace(split, predictor=_ColdRowsGate(gate, split.cpu_neurons))
                elif gate is not split.predictor:
                    split = replace(split, predictor=gate)
                splits.append(split)
        host_embed = hasattr(model.embed_tokens, "weight") and not _on_tier(model.embed_tokens)
        if not described and executor.head is None and not host_embed:
            return None  # nothing of the token on the host (its output layer and embedding included)
        try:
            native = load_native()
            layers, keep = FusedDecodeStep._describe_layers(_Subset(model, described), _Splits(executor, splits), native)
        except (NativeUnavailable, FusedDecodeUnavailable, TandemError, AttributeError):
            return None
        for i, layer in zip(described, layers):
            if i in hot:  # C adds only the cold rows' share; the tier norms the sum (Gemma 3's sandwich norm)
                layer.ffn_out_norm = None
        by_layer = dict(zip(described, layers))
        full = [by_layer.get(i, TdmLayer()) for i in range(model.cfg.num_layers)]
        head = executor.head
        if head is None:  # the head is on the tier: a stand-in the part calls (no logits) never read
            executor.head = QuantizedLinear.from_float(torch.zeros(8, model.cfg.hidden_size), fmt="int8")
        try:
            step = FusedDecodeStep(_RangeModel(model), executor, native, full, keep)
        except (FusedDecodeUnavailable, TandemError, AttributeError):
            return None
        finally:
            executor.head = head
        rows = int(model.embed_tokens.weight.shape[0]) if host_embed and hasattr(native.lib, "tdm_embed") else 0
        return cls(step, attention, ffn, hot, head=head is not None, embed_rows=rows)

    def run(self, first: int, last: int, pos: int, cache, residual: torch.Tensor, parts: int = BOTH,
            logits: torch.Tensor | None = None) -> int:
        """``parts`` of layers ``[first, last)`` on ``residual`` [d] in place; returns active neurons. With
        ``logits`` [vocab] (``has_head``, parts BOTH) also the final norm and the output layer, softcap
        included; ``first == last`` computes only those."""
        step = self.step
        if step._bound_cache is None or step._bound_cache() is not cache:
            step._bind(cache)
        if logits is None:
            return int(step.native.lib.tdm_decode_parts(ctypes.byref(step._desc), first, last, pos,
                                                        residual.data_ptr(), parts))
        if not self.has_head or parts != BOTH:
            raise TandemError("the C step's logits need the host's output layer and whole layers")
        return int(step.native.lib.tdm_decode_range(ctypes.byref(step._desc), first, last, pos,
                                                    residual.data_ptr(), logits.data_ptr()))

    def embed(self, token_id: int, pos: int, residual: torch.Tensor) -> None:
        """The token's input row at ``pos`` into ``residual`` [d] (``has_embed``)."""
        if not 0 <= token_id < self.embed_rows:  # C reads the row unchecked
            raise TandemError(f"token id {token_id} is outside the vocabulary (0..{self.embed_rows - 1})")
        self.step.native.lib.tdm_embed(ctypes.byref(self.step._desc), token_id, pos, residual.data_ptr())

    @property
    def vocab(self) -> int:
        """The output layer's rows (``has_head``; else a stand-in's)."""
        return int(self.step._desc.vocab)


def _c_reads_cold_rows(split) -> bool:
    """The C step computes the split's cold rows: no gate bias (decode.c reads only up's), a predictor only
    as an MLP scorer on the host (with hot rows on the tier, restricted to the cold rows: _ColdRowsGate; a
    predictor the plan put on the tier scores the cold rows through its host copy)."""
    cpu = split.cpu
    if cpu is None or getattr(cpu, "gate_bias", None) is not None and cpu.gate_bias.size:
        return False
    if split.predictor is None:
        return True
    return getattr(_host_gate(split.predictor), "module", None) is not None


def _host_gate(predictor):
    """The predictor as the host scores it: a tier predictor's host copy (``TierPredictor.host_gate``)."""
    return getattr(predictor, "host_gate", None) if _on_tier(predictor) else predictor


class _ColdRowsGate:
    """A layer's predictor (``predictors.runtime.LayerGate``) scoring only its cold rows, in the CPU part's
    order: the scorer's output rows ``up`` sliced to those neurons. The C step then gates the cold part like a
    layer of its own (PowerInfer: the CPU predicts and computes only its cold neurons)."""

    def __init__(self, gate, cold_neurons: torch.Tensor) -> None:
        module = gate.module
        up = SimpleNamespace(weight=module.up.weight.detach()[cold_neurons], bias=module.up.bias.detach()[cold_neurons])
        self.module = SimpleNamespace(down=module.down, up=up)  # down [rank, d]; up [n_cold, rank]
        self.threshold = gate.threshold


class _RangeModel:
    """The model for a parts descriptor: an embedding on the tier is stood in for (parts never embed)."""

    def __init__(self, model) -> None:
        self._model = model
        if not hasattr(model.embed_tokens, "weight"):
            self.embed_tokens = torch.nn.Embedding(1, model.cfg.hidden_size)

    def __getattr__(self, name):
        return getattr(self._model, name)


class _Subset:
    """The model as ``_describe_layers`` sees it: only some layers."""

    def __init__(self, model, layers: list) -> None:
        self.cfg, self.layers = model.cfg, [model.layers[i] for i in layers]
        self.rope_local_cos, self.rope_local_sin = model.rope_local_cos, model.rope_local_sin


class _Splits:
    def __init__(self, executor, splits: list) -> None:
        self.settings, self.splits = executor.settings, splits
