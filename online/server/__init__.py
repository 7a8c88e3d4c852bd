"""OpenAI-compatible HTTP server (``tandem serve``).

Example::

    from online import Engine
    from online.server import create_app
    app = create_app(Engine.load("smollm2"), api_key="secret", max_queue=64)
"""
from importlib import import_module

__all__ = ["create_app"]


def __getattr__(name: str):
    """Import the app (fastapi, the Engine) on first use: ``tandem serve --help`` must not pay for it."""
    if name in __all__:
        return getattr(import_module(".app", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
