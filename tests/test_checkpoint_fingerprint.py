"""Checkpoint.fingerprint is computed once at load: build_model emptying the tensors does not change it."""
from __future__ import annotations

import pytest

from online import Engine
from tandem.core.loading import load_checkpoint, model_fingerprint
from tandem.core.model.build import build_model


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_fingerprint_survives_build_model(tiny_model_dir, kind):
    folder, _ = tiny_model_dir(kind)
    ckpt = load_checkpoint(folder)
    shapes = {name: tuple(t.shape) for name, t in ckpt.tensors.items()}
    want = model_fingerprint(ckpt.config, shapes)
    assert ckpt.fingerprint == want
    build_model(ckpt)
    assert not ckpt.tensors  # consumed by the model
    assert ckpt.fingerprint == want
    assert Engine.load(str(folder)).model_fingerprint == want
