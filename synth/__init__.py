"""Synthetic-weights models of real shapes (``tandem synth``): ReLU-sparse by construction, in GGUF.

Example::

    from synth import SynthSpec, get_shape, synthesize
    synthesize(SynthSpec(get_shape("llama-1b"), sparsity=0.9), "models/synthetic", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
"""
from .build import SynthResult, SynthSpec, synthesize
from .shapes import SHAPES, Shape, get_shape

__all__ = ["SHAPES", "Shape", "SynthResult", "SynthSpec", "get_shape", "synthesize"]
