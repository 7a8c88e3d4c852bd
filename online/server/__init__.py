"""OpenAI-compatible HTTP server (``tandem serve``).

Example::

    from online import Engine
    from online.server import create_app
    app = create_app(Engine.load("smollm2"), api_key="secret", max_queue=64)
"""
from online.server.app import create_app

__all__ = ["create_app"]
