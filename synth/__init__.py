"""Synthetic-weights models of real shapes (``tandem synth``): ReLU-sparse by construction, in GGUF.

Example::

    from synth import SynthSpec, get_shape, synthesize
    synthesize(SynthSpec(get_shape("llama-1b"), sparsity=0.9), "models/synthetic", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
"""
from .shapes import SHAPES, Shape, get_shape

_LAZY = {"SynthResult", "SynthSpec", "synthesize"}  # .build imports torch: loaded on first use


def __getattr__(name: str):
    if name in _LAZY:
        from . import build
        return getattr(build, name)
    raise AttributeError(f"module 'synth' has no attribute {name!r}")

__all__ = ["SHAPES", "Shape", "SynthResult", "SynthSpec", "get_shape", "synthesize"]
