"""Runs of whole CPU layers inside a GPU step: layers whose attention and FFN rows all stay on the CPU go
through the fused C step (``tdm_decode_range`` over the run, no logits) instead of the modules, so a
run costs one exchange and one C call however many layers it holds.

Example::

    runs = CpuLayerRuns.build(model, executor, [3, 4, 5, 9])      # None where the C step does not apply
    runs.run(3, 6, pos, cache, residual)                          # residual [d] float32 (host), in place
"""
from __future__ import annotations

import ctypes

import torch

from tandem.core.errors import TandemError


def pure_cpu_layer(model, executor, layer: int) -> bool:
    """Attention on the host, no hot rows, a CPU part, no predictor on the tier."""
    block, split = model.layers[layer], executor.splits[layer]
    return (not getattr(block.self_attn, "on_tier", False) and split is not None and split.gpu is None
            and split.cpu is not None and not getattr(split.predictor, "on_tier", False))


class CpuLayerRuns:
    """The fused C step's descriptor for a subset of layers (the others blank: never run)."""

    def __init__(self, step, layers: list[int]) -> None:
        self.step, self.layers = step, set(layers)

    @classmethod
    def build(cls, model, executor, layers: list[int]) -> "CpuLayerRuns | None":
        from ..execution.fused_decode import FusedDecodeStep, FusedDecodeUnavailable
        from ..kernels.ffn import QuantizedLinear
        from ..kernels.native import NativeUnavailable, load_native
        from ..kernels.native.structs import TdmLayer
        if not layers:
            return None
        try:
            native = load_native()
            view_model, view_exec = _Subset(model, executor, layers)
            described, keep = FusedDecodeStep._describe_layers(view_model, view_exec, native)
        except (NativeUnavailable, FusedDecodeUnavailable, TandemError, AttributeError):
            return None
        by_layer = dict(zip(layers, described))
        full = [by_layer.get(i, TdmLayer()) for i in range(model.cfg.num_layers)]
        head = executor.head
        if head is None:  # the head is on the tier: a stand-in the range call (no logits) never reads
            executor.head = QuantizedLinear.from_float(torch.zeros(8, model.cfg.hidden_size), fmt="int8")
        try:
            step = FusedDecodeStep(_RangeModel(model), executor, native, full, keep)
        except (FusedDecodeUnavailable, TandemError, AttributeError):
            return None
        finally:
            executor.head = head
        return cls(step, layers)

    def run(self, first: int, last: int, pos: int, cache, residual: torch.Tensor) -> int:
        """Layers ``[first, last)`` (all in this set) on ``residual`` [d] in place; returns active neurons."""
        step = self.step
        if step._bound_cache is None or step._bound_cache() is not cache:
            step._bind(cache)
        return int(step.native.lib.tdm_decode_range(ctypes.byref(step._desc), first, last, pos,
                                                    residual.data_ptr(), None))


class _RangeModel:
    """The model for a range descriptor: an embedding on the tier is stood in for (a range never embeds)."""

    def __init__(self, model) -> None:
        self._model = model
        if not hasattr(model.embed_tokens, "weight"):
            self.embed_tokens = torch.nn.Embedding(1, model.cfg.hidden_size)

    def __getattr__(self, name):
        return getattr(self._model, name)


class _Subset:
    """``model`` / ``executor`` as ``_describe_layers`` sees them: only ``layers``."""

    def __new__(cls, model, executor, layers):
        class M:
            cfg = model.cfg
            rope_local_cos, rope_local_sin = model.rope_local_cos, model.rope_local_sin

        class E:
            settings = executor.settings
        M.layers = [model.layers[i] for i in layers]
        E.splits = [executor.splits[i] for i in layers]
        return M, E
