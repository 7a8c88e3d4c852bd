"""Online stage: load a model (and a plan) and generate text.

Example::

    from online import Engine
    engine = Engine.load("smollm2")
    print(engine.generate("The capital of France is", max_new_tokens=8).text)
"""
from importlib import import_module

__all__ = ["Engine", "GenerationResult"]


def __getattr__(name: str):
    """Import the Engine on first use: ``tandem --help`` and the offline stages must not pay for torch."""
    if name in __all__:
        return getattr(import_module(".engine", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
