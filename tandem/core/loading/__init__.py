"""Model loading: GGUF files and Hugging Face folders -> Checkpoint (canonical tensor names)."""
from __future__ import annotations

from pathlib import Path

from tandem.core.errors import TandemError


def load_checkpoint(model: str | Path, deferred: bool | None = False) -> Checkpoint:
    """Load ``model`` (alias such as "smollm2", a .gguf file, or a Hugging Face folder).
    ``deferred``: a GGUF's layer matrices and output layer stay in their blocks until used
    (loading/deferred.py); None: when their float32 copy would crowd the memory available
    (``deferred.defer_wanted``). A Hugging Face folder loads as usual.

    Example::

        ckpt = load_checkpoint("smollm2")
        ckpt.config.num_layers  # 30
    """
    from .resolve import resolve_model_path
    path = resolve_model_path(str(model))
    if path.is_dir():
        from .hf_loader import load_hf_folder
        return load_hf_folder(path)
    from .gguf_loader import load_gguf
    return load_gguf(path, deferred=deferred)


__all__ = ["Checkpoint", "TandemError", "load_checkpoint", "model_fingerprint"]


def __getattr__(name: str):
    """Checkpoint / model_fingerprint on first use (they import torch; the tokenizer does not)."""
    if name in ("Checkpoint", "model_fingerprint"):
        from . import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
