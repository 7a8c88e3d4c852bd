"""DeferredTensor: a float32 weight that stays in its GGUF blocks until something computes with it.

A packed engine reads the file's blocks as they are (the fused step, ``QuantizedLinear.from_gguf``),
so the float32 copy of each matrix is only needed briefly, if at all: to pack a format the file does
not store, to slice a plan's hot rows, or to run the float module graph. A deferred weight answers
its shape, dtype and device without decoding; every other torch operation decodes it (the blocks
are memory-mapped, so this is a read of the file's pages), runs on the float32 tensor, and lets that
tensor go with the result. A model whose float32 weights would not fit in memory then loads, plans
and packs one matrix at a time: the peak is the packed model plus one decoded matrix.

The decoded values are those ``load_gguf`` decodes eagerly (the same ``quants.dequantize``), so a
deferred checkpoint computes the same bits.

Example::

    w = DeferredTensor((576, 1536), lambda: torch.from_numpy(dequantize(data, "Q4_1", (576, 1536))))
    w.shape                      # torch.Size([576, 1536]), nothing decoded
    y = torch.nn.functional.linear(x, w)   # decodes w for this call only
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable

import torch

from tandem.core.errors import TandemError

# metadata that the meta-device stand-in answers exactly (shape, dtype, layout, sizes)
_METADATA = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__,
    torch.Tensor.layout.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.__len__, torch.Tensor.is_sparse.__get__,
    torch.Tensor.is_quantized.__get__, torch.Tensor.grad.__get__, torch.Tensor.is_leaf.__get__,
    torch.Tensor.grad_fn.__get__, torch.Tensor.itemsize.__get__, torch.Tensor.nbytes.__get__,
})
_CPU = torch.device("cpu")
_ON_CPU = {torch.Tensor.device.__get__: _CPU, torch.Tensor.is_meta.__get__: False, torch.Tensor.is_cpu.__get__: True,
           torch.Tensor.is_cuda.__get__: False}
# identity operations: a deferred weight stays deferred through nn.Parameter and requires_grad_(False)
_SELF = frozenset({torch.Tensor.detach, torch.Tensor.requires_grad_})


class DeferredTensor(torch.Tensor):
    """A float32 tensor of ``shape`` whose values ``load()`` decodes on each use (see the module doc)."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], load: Callable[[], torch.Tensor]) -> "DeferredTensor":
        stand_in = torch.empty(tuple(shape), dtype=torch.float32, device="meta")
        t = torch.Tensor._make_subclass(cls, stand_in, False)
        t._load = load
        t._decoded = None  # weakref to the last decoded tensor: reused while someone still holds it
        t._pinned = None  # the decoded tensor, kept for good (pin)
        return t

    def pin(self) -> torch.Tensor:
        """Decode once and keep the values: for a weight that a float path then uses on every token."""
        if self._pinned is None:
            self._pinned = self.materialize()
        return self._pinned

    def materialize(self) -> torch.Tensor:
        """The float32 values (a plain tensor; decoded again once no one holds the last one)."""
        if self._pinned is not None:
            return self._pinned
        ref = self._decoded
        out = ref() if ref is not None else None
        if out is None:
            out = self._load()
            if tuple(out.shape) != tuple(self.shape) or out.dtype != torch.float32:
                raise RuntimeError(f"deferred tensor decoded to {out.dtype} {list(out.shape)}, "
                                   f"expected float32 {list(self.shape)}")
            self._decoded = weakref.ref(out)
        return out

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"DeferredTensor(shape={list(self.shape)}, dtype=torch.float32)"

    def __reduce_ex__(self, protocol: int):
        return (_plain, (self.materialize(),))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ON_CPU:
            return _ON_CPU[func]
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _SELF and isinstance(args[0], DeferredTensor):
            return args[0]
        return func(*_decoded(args), **_decoded(kwargs))


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t


def _decoded(value: Any) -> Any:
    if isinstance(value, DeferredTensor):
        return value.materialize()
    if isinstance(value, (list, tuple)):
        items = [_decoded(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples too
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    return value


DEFER_ENV = "TANDEM_DEFER_WEIGHTS"
# a dense load defers above this share of the memory available: the float32 weights plus what the offline stages
# hold beside them (activations, a second engine while a plan's quality is measured) would not fit
DEFER_SHARE_OF_AVAILABLE = 0.75


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def pin_deferred(tensors) -> int:
    """Pin every DeferredTensor among ``tensors`` (None and plain tensors are skipped); returns how many."""
    n = 0
    for t in tensors:
        if isinstance(t, DeferredTensor):
            t.pin()
            n += 1
    return n


def defer_wanted(float32_bytes: int) -> bool:
    """Whether a dense (float32 modules) load should keep its layer weights deferred:
    ``$TANDEM_DEFER_WEIGHTS`` = 1 / 0 decides; otherwise when the float32 weights would take over three quarters
    of the memory available now (decoding on use costs time, running out of memory costs the run)."""
    choice = os.environ.get(DEFER_ENV, "").strip()
    if choice in ("0", "1"):
        return choice == "1"
    if choice:
        raise TandemError(f"{DEFER_ENV} must be 1 (decode each weight on use) or 0 (decode all at load), "
                          f"or unset to decide by the memory available; got {choice!r}")
    available = available_memory_bytes()
    return available is not None and float32_bytes > DEFER_SHARE_OF_AVAILABLE * available
