"""Online stage: load a model (and a plan) and generate text.

Example::

    from online import Engine
    engine = Engine.load("smollm2")
    print(engine.generate("The capital of France is", max_new_tokens=8).text)
"""
from .engine import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult"]
